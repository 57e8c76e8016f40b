"""Trajectory assembly, credit assignment and samples, from records in a real in-memory store."""

from __future__ import annotations

import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import Reward, RewardSource, RolloutStatus
from lightning_rl.store import InMemoryStore, get_credit_assigner, route_by_policy, split_rewards, trajectory_samples
from lightning_rl.store.training_samples import SampleStats

from .helpers import llm_span, rollout


def _store_with(calls, rewards=(), rid="r1"):
    s = InMemoryStore()
    s.start_rollout(rollout(rid))
    s.add_spans(calls)
    for r in rewards:
        s.write_reward(r)
    s.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)
    return s


def test_calls_ordered_by_per_rollout_index_not_clock():
    # seq 0 has the latest clock in helpers; index decides the order.
    s = _store_with([llm_span("r1", 0, 1, [1, 2, 3], [4]), llm_span("r1", 1, 0, [1], [2])])
    assert [c.index for c in lrl.trajectory(s, "r1").llm_calls] == [0, 1]


def test_missing_token_ids_are_reported_and_kept_out_of_samples():
    s = _store_with([llm_span("r1", 0, 0, [1], [2]), llm_span("r1", 1, 1, [], [], source="missing")],
                    [Reward(rollout_id="r1", value=1.0, source=RewardSource.RETURNED)])
    t = lrl.trajectory(s, "r1")
    assert t.missing_token_ids == 1 and len(t.llm_calls) == 2
    samples, stats = trajectory_samples(t)
    assert len(samples) == 1 and stats.missing_token_ids == 1


def R(value, index=None, source=RewardSource.EMITTED, name="reward"):
    return Reward(rollout_id="r1", value=value, llm_call_index=index, source=source, name=name)


def test_split_rewards_rules():
    final, steps = split_rewards([R(0.1, 0), R(0.2, 1), R(1.0, source=RewardSource.RETURNED)], 3)
    assert final == 1.0 and steps == [0.1, 0.2, 0.0]
    # no rollout-level reward: the latest emitted one is final, and not also a step
    final, steps = split_rewards([R(0.1, 0), R(0.7, 2)], 3)
    assert final == 0.7 and steps == [0.1, 0.0, 0.0]
    # emitted before any call finished (index None) goes to call 0; other names are ignored
    final, steps = split_rewards([R(0.3, None), R(5.0, 1, name="other"), R(1.0, None, RewardSource.FEEDBACK)], 2)
    assert final == 1.0 and steps == [0.3, 0.0]
    # late feedback overrides the returned reward (latest rollout-level reward wins)
    final, _ = split_rewards([R(1.0, source=RewardSource.RETURNED), R(0.0, source=RewardSource.FEEDBACK)], 1)
    assert final == 0.0


@pytest.mark.parametrize(
    "name,kwargs,expected",
    [
        ("final", {}, [1.0, 1.0, 1.0]),
        ("discounted", {"gamma": 0.5}, [0.25, 0.5, 1.0]),
        ("per_step", {}, [1.5, 1.0, 1.25]),
        ("return_to_go", {"gamma": 1.0}, [1.75, 1.25, 1.25]),
    ],
)
def test_credit_assigners(name, kwargs, expected):
    assert get_credit_assigner(name)(3, 1.0, [0.5, 0.0, 0.25], **kwargs) == pytest.approx(expected)


def test_credit_without_any_reward_gives_none():
    for name in ("final", "discounted", "per_step", "return_to_go"):
        assert get_credit_assigner(name)(2, None, [0.0, 0.0]) == [None, None]


def test_unknown_credit_lists_known_names():
    with pytest.raises(lrl.UnknownNameError) as info:
        get_credit_assigner("montecarlo")
    message = str(info.value)
    assert "montecarlo" in message and all(n in message for n in ("final", "discounted", "per_step"))
    assert isinstance(info.value, KeyError)


def test_registered_credit_is_usable_by_name():
    @lrl.register_credit("last_only")
    def last_only(n, final, steps):
        return [None] * (n - 1) + [final]

    s = _store_with([llm_span("r1", 0, 0, [1], [2]), llm_span("r1", 1, 1, [1, 2, 9], [3])],
                    [R(1.0, source=RewardSource.RETURNED)])
    assert [c.reward for c in lrl.trajectory(s, "r1", credit="last_only").llm_calls] == [None, 1.0]


def test_call_level_samples():
    s = _store_with([llm_span("r1", 0, 0, [1, 2], [3, 4], logprobs=[-0.1, -0.2])],
                    [R(1.0, source=RewardSource.RETURNED)])
    (sample,), stats = trajectory_samples(lrl.trajectory(s, "r1"), level="call")
    assert (sample.prompt_ids, sample.response_ids, sample.response_mask) == ([1, 2], [3, 4], [1, 1])
    assert sample.rollout_logprobs == [-0.1, -0.2] and sample.reward == 1.0
    assert sample.group_id == s.get_rollout("r1").group_id and stats.samples == 1


def test_trajectory_level_merges_exact_prefix_with_observation_mask():
    calls = [
        llm_span("r1", 0, 0, [1, 2], [3, 4], logprobs=[-0.1, -0.2]),
        llm_span("r1", 1, 1, [1, 2, 3, 4, 7, 8], [5], logprobs=[-0.3]),  # 7, 8 = tool result tokens
        llm_span("r1", 2, 2, [1, 2, 3, 4, 7, 8, 5, 9], [6], logprobs=[-0.4]),
    ]
    s = _store_with(calls, [R(0.5, 1), R(1.0, source=RewardSource.RETURNED)])
    (sample,), stats = trajectory_samples(lrl.trajectory(s, "r1", credit="per_step"), level="trajectory")
    assert sample.prompt_ids == [1, 2]
    assert sample.response_ids == [3, 4, 7, 8, 5, 9, 6]
    assert sample.response_mask == [1, 1, 0, 0, 1, 0, 1]
    assert sample.rollout_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4]
    assert sample.token_rewards == [0.0, 1.0, 0.0, 0.0, 1.5, 0.0, 1.0]
    assert sample.reward == 1.0 and sample.llm_call_indices == [0, 1, 2]
    assert stats.splits == 0


def test_trajectory_level_splits_on_broken_prefix_and_counts_it():
    calls = [
        llm_span("r1", 0, 0, [1, 2], [3]),
        llm_span("r1", 1, 1, [1, 2, 99, 5], [6]),  # re-rendered history: not an extension
        llm_span("r1", 2, 2, [1, 2, 99, 5, 6, 7], [8]),
    ]
    s = _store_with(calls, [R(1.0, source=RewardSource.RETURNED)])
    samples, stats = trajectory_samples(lrl.trajectory(s, "r1"), level="trajectory")
    assert [x.llm_call_indices for x in samples] == [[0], [1, 2]]
    assert stats.splits == 1


def test_agent_selection_by_names_or_regex():
    calls = [llm_span("r1", 0, 0, [1], [2], agent="writer"), llm_span("r1", 1, 1, [1, 2, 3], [4], agent="critic"),
             llm_span("r1", 2, 2, [5], [6], agent="writer-2")]
    s = _store_with(calls, [R(1.0, source=RewardSource.RETURNED)])
    t = lrl.trajectory(s, "r1")
    assert [x.agent_name for x in trajectory_samples(t, agents=["critic"])[0]] == ["critic"]
    assert [x.agent_name for x in trajectory_samples(t, agents="writer.*")[0]] == ["writer", "writer-2"]


def test_store_samples_skip_failed_and_unrewarded_rollouts():
    s = _store_with([llm_span("ok", 0, 0, [1], [2])], [Reward(rollout_id="ok", value=1.0, source="returned")], rid="ok")
    s.start_rollout(rollout("bad"))
    s.add_spans([llm_span("bad", 0, 0, [1], [2])])
    s.write_reward(Reward(rollout_id="bad", value=1.0, source="returned"))
    s.finish_rollout("bad", RolloutStatus.FAILED, time.time(), "model call failed")
    s.start_rollout(rollout("none"))
    s.add_spans([llm_span("none", 0, 0, [1], [2])])
    s.finish_rollout("none", RolloutStatus.SUCCEEDED, time.time(), None)
    samples, stats = lrl.samples(s)
    assert [x.rollout_id for x in samples] == ["ok"] and stats.skipped_unrewarded == 1
    with pytest.raises(ValueError, match="level 'episode'"):
        lrl.samples(s, level="episode")


def _team_store(rewards):
    calls = [llm_span("r1", 0, 0, [1], [2], agent="writer"), llm_span("r1", 1, 1, [1, 2, 3], [4], agent="critic"),
             llm_span("r1", 2, 2, [1, 2, 3, 4, 5], [6], agent="writer")]
    return _store_with(calls, rewards)


def test_shared_team_reward_goes_to_every_selected_agents_calls():
    s = _team_store([R(1.0, source=RewardSource.RETURNED)])
    t = lrl.trajectory(s, "r1")
    assert [c.reward for c in t.llm_calls] == [1.0, 1.0, 1.0]
    writer, _ = trajectory_samples(t, agents=["writer"])
    assert [(x.agent_name, x.reward, x.llm_call_indices) for x in writer] == [("writer", 1.0, [0]), ("writer", 1.0, [2])]
    everyone, _ = trajectory_samples(t)
    assert {x.agent_name for x in everyone} == {"writer", "critic"}


def test_per_agent_reward_replaces_team_reward_for_that_agent_only():
    s = _team_store([R(1.0, source=RewardSource.RETURNED),
                     Reward(rollout_id="r1", value=-0.5, agent="critic", llm_call_index=1, source="emitted")])
    t = lrl.trajectory(s, "r1")
    assert [c.reward for c in t.llm_calls] == [1.0, -0.5, 1.0]
    assert t.final_reward == 1.0


def test_agent_feedback_after_the_rollout():
    s = _team_store([R(0.0, source=RewardSource.RETURNED)])
    s.add_reward("r1", 0.8, agent="writer")
    assert [c.reward for c in lrl.trajectory(s, "r1").llm_calls] == [0.8, 0.0, 0.8]


def test_discounting_runs_along_each_agents_own_calls():
    s = _team_store([R(1.0, source=RewardSource.RETURNED)])
    t = lrl.trajectory(s, "r1", credit="discounted", gamma=0.5)
    assert [c.reward for c in t.llm_calls] == [0.5, 1.0, 1.0]  # writer: 2 calls; critic: its last call


# -- teams: the team rule, and samples routed to each agent's policy ----------------------------------
def test_team_credit_adds_an_agents_own_reward_to_the_shared_one():
    """Under ``team`` the shared reward reaches every agent that took part, and an agent's own
    reward adds to it for that agent only (under ``final`` it replaces it)."""
    rewards = [R(1.0, source=RewardSource.RETURNED), Reward(rollout_id="r1", value=0.25, agent="critic")]
    s = _team_store(rewards)
    assert [c.reward for c in lrl.trajectory(s, "r1", credit="team").llm_calls] == [1.0, 1.25, 1.0]
    assert [c.reward for c in lrl.trajectory(s, "r1", credit="final").llm_calls] == [1.0, 0.25, 1.0]
    only_own = _team_store([Reward(rollout_id="r1", value=0.25, agent="critic")])
    assert [c.reward for c in lrl.trajectory(only_own, "r1", credit="team").llm_calls] == [None, 0.25, None]


def test_an_agents_emitted_step_reward_lands_on_its_own_call():
    """Emitted mid-run after the writer's call 2, a step reward for the critic (0.5) belongs to the
    critic's latest call (1), not to the call it happened to follow; the critic's latest emitted
    reward (0.1) is its own final reward, added to the team's."""
    rewards = [R(1.0, source=RewardSource.RETURNED),
               Reward(rollout_id="r1", value=0.5, agent="critic", llm_call_index=2, source="emitted"),
               Reward(rollout_id="r1", value=0.1, agent="critic", llm_call_index=1, source="emitted")]
    s = _team_store(rewards)
    assert [c.reward for c in lrl.trajectory(s, "r1", credit="team").llm_calls] == [1.0, 1.5 + 0.1, 1.0]
    ghost = _team_store([R(1.0, source=RewardSource.RETURNED),
                         Reward(rollout_id="r1", value=9.0, agent="ghost", llm_call_index=0, source="emitted"),
                         Reward(rollout_id="r1", value=0.5, agent="ghost", llm_call_index=1, source="emitted")])
    before = lrl.stats().get("agent_rewards_without_calls", 0)
    assert [c.reward for c in lrl.trajectory(ghost, "r1", credit="team").llm_calls] == [1.0, 1.0, 1.0]
    assert lrl.stats()["agent_rewards_without_calls"] == before + 1  # 0.5 is ghost's final; 9.0 had no call to go to


def _two_policy_store():
    calls = [llm_span("r1", 0, 0, [1], [2], agent="planner", model="planner-lora"),
             llm_span("r1", 1, 1, [1, 2, 3], [4], agent="solver", model="solver-lora"),
             llm_span("r1", 2, 2, [1, 2, 3, 4, 5], [6], agent="planner", model="planner-lora"),
             llm_span("r1", 3, 3, [7], [8], agent="planner", model="judge")]  # a model nobody trains
    return _store_with(calls, [R(1.0, source=RewardSource.RETURNED)])


@pytest.mark.parametrize("level", ["call", "trajectory"])
def test_samples_are_routed_by_the_served_model_name(level):
    t = lrl.trajectory(_two_policy_store(), "r1", credit="team")
    samples, stats = trajectory_samples(t, level=level)
    before = lrl.stats().get("samples_unrouted", 0)
    routed = route_by_policy(samples, ["planner-lora", "solver-lora"], stats)
    assert {name: [x.llm_call_indices for x in group] for name, group in routed.items()} == {
        "planner-lora": [[0], [2]] if level == "call" else [[0], [2]],
        "solver-lora": [[1]],
    }
    assert all(x.policy == name for name, group in routed.items() for x in group)
    assert all(x.reward == 1.0 for group in routed.values() for x in group)
    assert stats.unrouted == 1 and lrl.stats()["samples_unrouted"] == before + 1  # the call to "judge"


def test_trajectory_samples_never_merge_calls_served_by_different_policies():
    calls = [llm_span("r1", 0, 0, [1], [2], agent="a", model="p1"),
             llm_span("r1", 1, 1, [1, 2, 3], [4], agent="a", model="p2")]  # extends the prefix, another policy
    samples, stats = trajectory_samples(lrl.trajectory(_store_with(calls, [R(1.0, source=RewardSource.RETURNED)]), "r1"),
                                        level="trajectory")
    assert [(x.policy, x.llm_call_indices) for x in samples] == [("p1", [0]), ("p2", [1])] and stats.splits == 1


def test_route_by_policy_wants_names():
    with pytest.raises(lrl.ConfigurationError, match="non-empty collection of served model names"):
        route_by_policy([], "planner")
    assert route_by_policy([], ["a"], SampleStats()) == {"a": []}


def test_a_step_reward_for_a_call_the_rollout_does_not_have_is_counted_not_lost_silently():
    """``add_reward(..., llm_call_index=7)`` on a rollout of 3 calls has no call to land on: it is left out
    of the credit, and counted (``step_rewards_beyond_calls``), as an agent's reward without calls is."""
    rewards = [R(1.0, source=RewardSource.RETURNED),
               Reward(rollout_id="r1", value=0.5, llm_call_index=7, source="emitted"),
               Reward(rollout_id="r1", value=0.25, llm_call_index=1, source="emitted")]
    s = _team_store(rewards)
    before = lrl.stats().get("step_rewards_beyond_calls", 0)
    assert [c.reward for c in lrl.trajectory(s, "r1", credit="team").llm_calls] == [1.0, 1.25, 1.0]
    assert lrl.stats().get("step_rewards_beyond_calls", 0) == before + 1
