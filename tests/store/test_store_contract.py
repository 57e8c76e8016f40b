"""The contract every store meets (SQLiteStore and InMemoryStore alike)."""

from __future__ import annotations

import math
import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import Reward, RewardSource, RolloutStatus
from lightning_rl.store import expire_idle_running

from .helpers import llm_span, rollout


def test_rollout_lifecycle_and_spans_in_sequence_order(store):
    store.start_rollout(rollout("r1"))
    store.add_spans([llm_span("r1", 1, 1, [1, 2], [3]), llm_span("r1", 0, 0, [1], [2])])
    store.finish_rollout("r1", RolloutStatus.SUCCEEDED, time.time(), None)
    store.flush()
    r = store.get_rollout("r1")
    assert r.status == "succeeded" and r.end_time is not None and r.task == {"q": "r1"}
    assert [s.seq for s in store.spans("r1")] == [0, 1]


def test_terminal_status_is_final(store):
    store.start_rollout(rollout("r1"))
    store.finish_rollout("r1", RolloutStatus.FAILED, time.time(), "boom")
    store.finish_rollout("r1", RolloutStatus.SUCCEEDED, time.time(), None)  # not allowed: ignored, counted
    store.flush()
    assert store.get_rollout("r1").status == "failed"


def test_spans_are_idempotent_by_rollout_and_seq(store):
    store.start_rollout(rollout("r1"))
    span = llm_span("r1", 0, 0, [1], [2])
    store.add_spans([span])
    store.add_spans([span])
    assert len(store.spans("r1")) == 1


def test_late_reward_after_rollout_end(store):
    store.start_rollout(rollout("r1"))
    store.add_spans([llm_span("r1", 0, 0, [1], [2])])
    store.finish_rollout("r1", RolloutStatus.SUCCEEDED, time.time(), None)
    store.flush()
    assert next(lrl.trajectories(store)).final_reward is None
    reward = store.add_reward("r1", 1.0, name="reward")
    assert reward.source == RewardSource.FEEDBACK
    t = lrl.trajectory(store, "r1")
    assert t.final_reward == 1.0 and t.llm_calls[0].reward == 1.0
    store.add_reward("r1", -1.0, name="user_feedback")
    assert lrl.trajectory(store, "r1", reward_name="user_feedback").final_reward == -1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1", None])
def test_add_reward_rejects_bad_values_and_keeps_existing(store, bad):
    store.start_rollout(rollout("r1"))
    store.add_reward("r1", 0.5)
    with pytest.raises(ValueError, match="finite real number"):
        store.add_reward("r1", bad)
    assert [r.value for r in store.rewards("r1")] == [0.5]


def test_unknown_rollout_is_a_clear_key_error(store):
    with pytest.raises(lrl.RolloutNotFoundError, match="no rollout 'nope'.*rollouts ls"):
        store.add_reward("nope", 1.0)
    with pytest.raises(KeyError):
        store.get_rollout("nope")


def test_filters_mode_since_policy_version_agent_status(store):
    store.start_rollout(rollout("old", mode="train", policy_version=0, start_time=100.0))
    store.start_rollout(rollout("new", mode="prod", policy_version=2, start_time=200.0))
    store.start_rollout(rollout("eval", mode="eval", policy_version=2, start_time=300.0))
    store.add_spans([llm_span("new", 0, 0, [1], [2], agent="writer")])
    store.finish_rollout("eval", RolloutStatus.FAILED, 301.0, "x")
    store.flush()
    ids = lambda **kw: [t.rollout_id for t in lrl.trajectories(store, **kw)]  # noqa: E731
    assert ids() == ["old", "new", "eval"]
    assert ids(mode="prod") == ["new"]
    assert ids(since=150.0) == ["new", "eval"]
    assert ids(min_policy_version=1) == ["new", "eval"]
    assert ids(agent="writer") == ["new"]
    assert ids(status="failed") == ["eval"]
    with pytest.raises(ValueError, match="mode 'nightly'"):
        list(lrl.trajectories(store, mode="nightly"))
    with pytest.raises(ValueError, match="status 'done'"):
        store.rollouts(status="done")


def test_reward_record_validation_on_construction():
    with pytest.raises(ValueError, match="nan"):
        Reward(rollout_id="r", value=math.nan)
    with pytest.raises(ValueError, match="extra"):
        Reward(rollout_id="r", value=1.0, colour="red")


def test_running_rollouts_nothing_reached_for_the_idle_time_end_timed_out(store):
    """What a killed opener leaves running is ended; what is active, held, finished, or of another
    origin is not. Activity is the start, the last span's end and the last reward."""
    now = time.time()
    old = now - 100
    for rid, origin in (("quiet", "gateway"), ("spanned", "gateway"), ("rewarded", "gateway"), ("held", "gateway"),
                        ("fresh", "gateway"), ("traced", None), ("done", "gateway")):
        store.start_rollout(rollout(rid, start_time=now - 5 if rid == "fresh" else old, origin=origin))
    span = llm_span("spanned", 0, 0, [1], [2])
    span.start_ns, span.end_ns = int((now - 6) * 1e9), int((now - 5) * 1e9)  # a call that ended 5 s ago
    store.add_spans([span])
    store.write_reward(Reward(rollout_id="rewarded", value=1.0, source=RewardSource.EMITTED, time=now - 5))
    store.finish_rollout("done", RolloutStatus.SUCCEEDED, old + 1, None)
    store.flush()
    assert store.get_rollout("quiet").origin == "gateway" and store.get_rollout("traced").origin is None

    ended = expire_idle_running(store, 60, origin="gateway", keep={"held"}, now=now)
    assert ended == ["quiet"]
    quiet = store.get_rollout("quiet")
    assert quiet.status == "timed_out" and "nothing reached this rollout for 60 s" in quiet.error
    assert {r: store.get_rollout(r).status for r in ("spanned", "rewarded", "held", "fresh", "traced", "done")} == {
        "spanned": "running", "rewarded": "running", "held": "running", "fresh": "running", "traced": "running",
        "done": "succeeded"}
    assert sorted(expire_idle_running(store, 60, now=now + 60)) == ["fresh", "held", "rewarded", "spanned", "traced"]
    with pytest.raises(lrl.ConfigurationError, match="idle_seconds must be a number of seconds > 0"):
        expire_idle_running(store, 0)


def test_token_arrays_given_as_attributes_are_kept_as_attributes_and_read_as_the_calls_tokens(store):
    """Tokens travel in ``Span.tokens``; a span whose arrays are attributes (the conventions' names) is
    stored as it came, not repacked, and assembly still reads its call's tokens from them."""
    from lightning_rl import semconv

    span = llm_span("r1", 0, 0, [1, 2], [3], source="engine")
    span.attributes.update({semconv.PROMPT_TOKEN_IDS: [5, 6], semconv.RESPONSE_TOKEN_IDS: [7],
                            semconv.RESPONSE_LOGPROBS: [-0.25]})
    span.tokens = None
    store.start_rollout(rollout("r1"))
    store.add_spans([span])
    (stored,) = store.spans("r1")
    assert stored.tokens is None and stored.attributes[semconv.PROMPT_TOKEN_IDS] == [5, 6]
    (call,) = lrl.trajectory(store, "r1").llm_calls
    assert (call.prompt_token_ids, call.response_token_ids, call.response_logprobs) == ([5, 6], [7], [-0.25])


def test_decisions_are_kept_beside_the_publishes_with_their_figures(store):
    """The gate's and operators' decisions (issue 36): every store keeps them in order, with their figures,
    and they never count as publishes (the latest publish stays what the served name answers with)."""
    from lightning_rl.errors import ConfigurationError
    from lightning_rl.records import Decision

    store.record_policy("policy", 0, adapter="/a/v00000")
    figures = {"gate_n_candidate": 3, "gate_mean_candidate": 0.25, "gate_df": None, "gate_not_worse": False}
    store.record_decision("policy", 1, "evaluated", live_version=0, adapter="/c/v00001.1", figures=figures, time=10.0)
    store.record_decision("policy", 1, Decision.REFUSED, live_version=0, adapter="/c/v00001.1", figures=figures,
                          reason="lower bound -0.4 < -0.1", time=11.0)
    store.record_decision("other", 4, "promoted", live_version=3)
    store.record_decision("policy", 0, "rolled_back", live_version=2, adapter="/a/v00000", reason="by hand")
    found = store.decisions("policy")
    assert [(d.version, d.decision, d.live_version) for d in found] == [
        (1, Decision.EVALUATED, 0), (1, Decision.REFUSED, 0), (0, Decision.ROLLED_BACK, 2)]
    assert found[0].figures == figures and found[0].time == 10.0 and found[0].adapter == "/c/v00001.1"
    assert isinstance(found[0].figures["gate_not_worse"], bool)
    assert isinstance(found[0].figures["gate_n_candidate"], int)
    assert found[1].reason == "lower bound -0.4 < -0.1" and found[2].figures == {}
    assert [d.served_name for d in store.decisions()] == ["policy", "policy", "other", "policy"]
    assert [p.version for p in store.policies("policy")] == [0]  # decisions are not publishes
    with pytest.raises(ConfigurationError, match="decision must be one of"):
        store.record_decision("policy", 1, "maybe")
    with pytest.raises(ConfigurationError, match="figures"):
        store.record_decision("policy", 1, "evaluated", figures={"gate_lower_bound": math.nan})
    assert len(store.decisions()) == 4
    latest = store.latest_decisions()  # the last decision about each name: what a tracer routes by (a canary)
    assert {n: (d.version, d.decision) for n, d in latest.items()} == {
        "policy": (0, Decision.ROLLED_BACK), "other": (4, Decision.PROMOTED)}
    store.record_decision("policy", 2, "canary", live_version=0, figures={"canary_share": 0.1,
                                                                        "canary_name": "policy-candidate"})
    canary = store.latest_decisions()["policy"]
    assert canary.decision == Decision.CANARY and canary.figures["canary_share"] == 0.1
