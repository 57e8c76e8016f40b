"""Failed rollouts in the batch: the model's failures are trained with the failure reward, a group hit by
an infrastructure failure is left out whole, and the metrics line counts both."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.records import Rollout, RolloutStatus
from lightning_rl.trainer_bridge.failures import failure_kind
from lightning_rl.trainer_bridge.trainer import Trainer

from ..store.helpers import llm_span

# per group: (status, error, final reward) of each try
GROUPS = {
    "a": [("succeeded", None, 1.0), ("failed", "JSONDecodeError: Expecting value: line 1", None), ("succeeded", None, 0.0)],
    "b": [("succeeded", None, 1.0), ("failed", "APIConnectionError: Connection error.", None)],
    "c": [("succeeded", None, 1.0), ("timed_out", "lease of runner 'r' expired", None)],
}


def _run(store) -> list[str]:
    """Tries that ended as GROUPS says, through the real queue, each with two LLM calls."""
    groups = []
    for name, tries in GROUPS.items():
        entries = store.enqueue({"task": name}, n=len(tries))
        groups.append(entries[0].group_id)
        for entry, (status, error, reward) in zip(store.lease("r", limit=len(tries)), tries):
            rid = entry.rollout_id
            store.start_rollout(Rollout(rollout_id=rid, task=entry.task, group_id=entry.group_id, attempt=entry.attempt))
            store.add_spans([llm_span(rid, 1, 0, [1, 2], [3, 4]), llm_span(rid, 2, 1, [1, 2, 3, 4, 5], [6])])
            if reward is not None:
                store.add_reward(rid, reward, source="returned")
            store.finish_rollout(rid, RolloutStatus(status), time.time(), error)
            store.complete(entry.queue_id, "r", status)
    store.flush()
    return groups


@pytest.mark.parametrize("failure_reward", [0.0, -0.5])
def test_model_failures_train_infra_failures_drop_their_group(sqlite_store, tmp_path, failure_reward):
    groups = _run(sqlite_store)
    trainer = Trainer(agent=lambda t: 1.0, tasks=[{}], store=sqlite_store, model_dir="unused",
                      server_url="http://127.0.0.1:9", out_dir=tmp_path, n=3, progress=False,
                      failure_reward=failure_reward)
    samples, rewards, counts = trainer.step_batch(groups)
    assert {s.group_id for s in samples} == {groups[0]}  # groups b and c are left out whole
    assert len(samples) == 6  # 3 tries of group a x 2 calls (level="call")
    failed = [s for s in samples if s.reward == failure_reward and s.rollout_id in _failed(sqlite_store)]
    assert len(failed) == 2
    assert sorted(rewards) == sorted([1.0, failure_reward, 0.0])
    assert counts["model_failures"] == 1 and counts["infra_failures"] == 2
    assert counts["groups_dropped_infra"] == 2 and counts["tries_dropped_infra"] == 4
    assert counts["outcomes"] == {"succeeded": 4, "failed": 2, "timed_out": 1}
    assert counts["prefix_splits"] == 0 and counts["calls_without_engine_ids"] == 0


def _failed(store) -> set[str]:
    return {r.rollout_id for r in store.rollouts(status="failed")}


def test_failure_kinds():
    def rollout(status, error=None):
        return Rollout(rollout_id="x", status=status, error=error)

    assert failure_kind(rollout("succeeded")) is None
    assert failure_kind(rollout("timed_out", "rollout timeout")) == "infra"
    assert failure_kind(rollout("failed", "ValidationError: 1 validation error for AIMessage")) == "model"
    assert failure_kind(rollout("failed", "APITimeoutError: Request timed out.")) == "infra"
    assert failure_kind(rollout("failed", "MyToolDown: 503"), infra_errors={"MyToolDown"}) == "infra"
    # a sandbox that could not start or died is the infrastructure's (lightning_rl.sandbox); a command the model
    # wrote that failed in it is the model's (the agent sees its exit code)
    assert failure_kind(rollout("failed", "SandboxError: the bwrap sandbox backend cannot run here")) == "infra"


def test_grpo_needs_groups(tmp_path, sqlite_store):
    import lightning_rl as lrl

    with pytest.raises(lrl.ConfigurationError, match="n >= 2.*batch_baseline"):
        Trainer(agent=lambda t: 1.0, tasks=[{}], store=sqlite_store, model_dir="unused",
                server_url="http://127.0.0.1:9", out_dir=tmp_path, n=1, progress=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(policies={}), "must map agent names to served model names"),
    (dict(policies=["planner"]), "must map agent names to served model names"),
    (dict(policies={"planner": ""}), "is not agent name -> served name"),
    (dict(policies={"planner": "p-lora"}, agents=["planner", "solver"]), r"agent\(s\) \['solver'\] have no policy"),
    (dict(policies={"planner": "p-lora"}, agents="plan.*"), "must list agent names"),
    (dict(policies={"planner": "p-lora"}, publisher=object()), "drop publisher="),
])
def test_bad_policies_are_refused_before_anything_runs(sqlite_store, tmp_path, kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        Trainer(agent=lambda t: 1.0, tasks=[{}], store=sqlite_store, model_dir="unused", server_url="http://x:1",
                out_dir=tmp_path, **kwargs)
    assert sqlite_store.rollouts() == []


def test_policies_name_the_agents_trained_and_share_served_names(sqlite_store, tmp_path):
    trainer = Trainer(agent=lambda t: 1.0, tasks=[{}], store=sqlite_store, model_dir="unused", server_url="http://x:1",
                      out_dir=tmp_path, policies={"planner": "team-lora", "critic": "team-lora", "solver": "s-lora"})
    assert trainer.trained_agents == ["planner", "critic", "solver"]
    assert trainer.policy_names == ["team-lora", "s-lora"]
    assert trainer.agents is None  # what was given stays as it was: the trainer derives, it does not rewrite


def test_one_policy_is_a_team_of_one(sqlite_store, tmp_path):
    one = Trainer(agent=lambda t: 1.0, tasks=[{}], store=sqlite_store, model_dir="unused", server_url="http://x:1",
                  out_dir=tmp_path, served_name="calc-lora")
    assert one.policy_names == ["calc-lora"] and one.trained_agents is None  # every agent trains it
    picked = Trainer(agent=lambda t: 1.0, tasks=[{}], store=sqlite_store, model_dir="unused", server_url="http://x:1",
                     out_dir=tmp_path, agents="solv.*")
    assert picked.trained_agents == "solv.*"  # one policy: agents may be a pattern


def test_the_settings_are_keyword_only_checked_and_never_rewritten(sqlite_store, tmp_path):
    import pydantic

    from lightning_rl.trainer_bridge.config import LocalConfig

    common = dict(agent=lambda t: 1.0, tasks=[{}], store=sqlite_store, model_dir="unused", server_url="http://x:1",
                  out_dir=tmp_path)
    with pytest.raises(TypeError):
        Trainer(lambda t: 1.0, [{}], sqlite_store, "unused", "http://x:1")  # the old positional form
    for bad, message in [(dict(n=True), r"Trainer.n must be an int, got True \(tries per task"),
                         (dict(steps=0), "Trainer.steps must be an int >= 1, got 0"),
                         (dict(level="turn"), "Trainer.level must be one of 'call' or 'trajectory', got 'turn'"),
                         (dict(backend="verl"), "Trainer.backend is not a setting of Trainer"),
                         (dict(failure_reward=float("nan")), "Trainer.failure_reward"),
                         (dict(local=LocalConfig(policy_config={"ghost": {"lr": 1e-4}})), r"names policies.*\['ghost'\]"),
                         (dict(init_adapter={"ghost": tmp_path}), r"does not train: \['ghost'\]")]:
        with pytest.raises(ConfigurationError, match=message):
            Trainer(**common, **bad)
    with pytest.raises(lrl_unknown_name(), match="unknown credit assignment 'bogus'; known: .*final"):
        Trainer(**common, credit="bogus")
    trainer = Trainer(**common, overlap=True)
    assert trainer.max_staleness == 1 and trainer.out_dir == tmp_path
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        trainer.steps = 3


def lrl_unknown_name():
    from lightning_rl.errors import UnknownNameError

    return UnknownNameError


def test_a_sample_trains_the_policy_that_served_it_else_the_every_agent_policy():
    from lightning_rl.records import Sample
    from lightning_rl.trainer_bridge.policies import Policies

    def sample(agent, served):
        return Sample(prompt_ids=[1], response_ids=[2], response_mask=[1], agent_name=agent, policy=served)

    team = Policies.of({"planner": "planner-lora", "solver": "solver-lora"})
    one = Policies.of(served_name="policy")
    calls = [sample("planner", "planner-lora"), sample("solver", "planner-lora"), sample("solver", "tiny"),
             sample("solver", None)]
    assert [team.trains(s) for s in calls] == ["planner-lora", "planner-lora", None, None]
    assert [one.trains(s) for s in calls] == ["policy"] * 4  # one policy trains every call its agents make
    assert [team.serving(s) for s in calls] == ["planner-lora", "planner-lora", None, None]
    assert [one.serving(s) for s in calls] == [None, None, None, "policy"]  # a call naming no model: the "*" one
    routed, unrouted = team.route(calls)
    assert {k: len(v) for k, v in routed.items()} == {"planner-lora": 2, "solver-lora": 0} and unrouted == 2
    assert team.off_their_policy(calls) == 3 and one.off_their_policy(calls) == 4  # none went to "policy"
    assert one.folders("out") == {"policy": Path("out")}
    assert team.folders("out") == {"planner-lora": Path("out/planner-lora"), "solver-lora": Path("out/solver-lora")}
    assert one.figures({"policy": {"loss": 1.0, "policy_version": 2}}, own=("policy_version",)) == {
        "loss": 1.0, "policies": {"policy": {"loss": 1.0, "policy_version": 2}}}
    assert team.figures({"planner-lora": {"loss": 1.0}}) == {"policies": {"planner-lora": {"loss": 1.0}}}
