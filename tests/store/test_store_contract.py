"""The contract every store meets (SQLite, memory, HTTP, PostgreSQL and the toy kit backend alike)."""

from __future__ import annotations

import math
import time

import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.records import QueueStatus, Reward, RewardSource, RolloutStatus
from lightning_rl.store import expire_idle_running, wait_for_groups

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


# -- cancelling queued tries (verl's agent loop gives up on a try it queued) --------------------------------
def _statuses(store, group_id: str) -> dict[str, QueueStatus]:
    return {e.queue_id: e.status for e in store.queue_entries([group_id])}


def test_a_cancelled_queued_try_is_never_leased_and_its_group_is_settled(store):
    first, second = store.enqueue({"q": 1}, n=2)
    assert store.cancel([first.queue_id], reason="the trainer stopped waiting") == [first.queue_id]
    assert _statuses(store, first.group_id) == {first.queue_id: "cancelled", second.queue_id: "queued"}
    (leased,) = store.lease("r", limit=5)
    assert leased.queue_id == second.queue_id and store.lease("r", limit=5) == []
    assert not wait_for_groups(store, [first.group_id], timeout=0)  # the other try still runs
    assert store.complete(leased.queue_id, "r", "succeeded")
    assert wait_for_groups(store, [first.group_id], timeout=1)  # a cancelled try is not waited for
    (cancelled,) = [e for e in store.queue_entries([first.group_id]) if e.queue_id == first.queue_id]
    assert cancelled.status == QueueStatus.CANCELLED and cancelled.tries == 0 and cancelled.outcome is None


def test_a_cancelled_leased_try_loses_its_lease_and_its_result_is_refused_and_counted(store):
    (entry,) = store.enqueue({"q": 1}, n=1)
    (held,) = store.lease("runner-1", lease_seconds=30)
    # its runner started the rollout and keeps running it while the trainer gives up on the try
    store.start_rollout(lrl.Rollout(rollout_id=held.rollout_id, task={"q": 1}, group_id=held.group_id))
    store.flush()
    diagnostics.reset()
    assert store.cancel([entry.queue_id], reason="verl's external_timeout of 600 s") == [entry.queue_id]
    assert not store.heartbeat(held.queue_id, "runner-1")  # the runner learns it lost the try
    store.finish_rollout(held.rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)  # reported anyway
    assert not store.complete(held.queue_id, "runner-1", "succeeded")
    assert not store.complete(held.queue_id, "runner-1", "succeeded")  # a retry is refused the same way
    assert diagnostics.counters().get("queue_results_refused_cancelled") == 2
    store.flush()
    stray = store.get_rollout(held.rollout_id)  # kept, never a train rollout that looks normal
    assert stray.status == RolloutStatus.TIMED_OUT and "cancelled" in stray.error and "external_timeout" in stray.error
    assert store.rollouts(status="succeeded") == []
    (after,) = store.queue_entries([entry.group_id])
    assert after.status == QueueStatus.CANCELLED and after.outcome is None and after.lease_expires is None


def test_a_leased_try_cancelled_before_its_agent_started_stays_timed_out_when_it_starts(store):
    (entry,) = store.enqueue({"q": 1}, n=1)
    (held,) = store.lease("slow", lease_seconds=30)
    assert store.cancel([entry.queue_id]) == [entry.queue_id]
    store.flush()
    assert store.get_rollout(held.rollout_id).status == RolloutStatus.TIMED_OUT  # a row before it ever starts
    store.start_rollout(lrl.Rollout(rollout_id=held.rollout_id, task={"q": 1}, group_id=held.group_id))
    store.finish_rollout(held.rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)
    store.flush()
    assert store.get_rollout(held.rollout_id).status == RolloutStatus.TIMED_OUT


def test_cancelling_a_done_try_changes_nothing_and_unknown_ids_are_ignored(store):
    done, waiting = store.enqueue({"q": 1}, n=2)
    (held,) = store.lease("r")
    store.start_rollout(lrl.Rollout(rollout_id=held.rollout_id, task={"q": 1}, group_id=held.group_id))
    store.finish_rollout(held.rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)
    assert held.queue_id == done.queue_id and store.complete(held.queue_id, "r", "succeeded")
    before = {e.queue_id: e for e in store.queue_entries([done.group_id])}
    assert store.cancel([done.queue_id, "no-such-try"]) == []
    assert {e.queue_id: e for e in store.queue_entries([done.group_id])} == before
    assert store.get_rollout(held.rollout_id).status == RolloutStatus.SUCCEEDED
    assert store.complete(held.queue_id, "r", "succeeded")  # its runner's retry is still told yes
    # several at once, in the order given; a retried request (an answer lost on the way) gets the same answer
    assert store.cancel([waiting.queue_id, done.queue_id, waiting.queue_id]) == [waiting.queue_id]
    assert store.cancel([waiting.queue_id]) == [waiting.queue_id]
    assert store.cancel([]) == []


def test_an_expired_lease_does_not_bring_a_cancelled_try_back(store):
    (entry,) = store.enqueue({"q": 1}, n=1, max_tries=3)
    (held,) = store.lease("r", lease_seconds=0.1)
    assert store.cancel([entry.queue_id]) == [entry.queue_id]
    time.sleep(0.2)  # the lease it had has run out
    assert store.lease("other", lease_seconds=10) == []
    (after,) = store.queue_entries([entry.group_id])
    assert after.status == QueueStatus.CANCELLED and after.tries == 1
    assert not store.heartbeat(held.queue_id, "r") and not store.complete(held.queue_id, "r", "failed")


def test_a_late_result_of_an_expired_try_never_ends_its_retry_leased_to_the_same_runner(store):
    # the soak test's failure (CI, 2026-11-29): the server came back after its runner's lease ran out, the runner's
    # own lease request re-leased the try to it, and the first try's late complete ended the retry before it ran
    (entry,) = store.enqueue({"q": 1}, n=1, max_tries=3)
    (first,) = store.lease("r", lease_seconds=0.1)
    time.sleep(0.2)
    (retry,) = store.lease("r", lease_seconds=30)
    assert retry.queue_id == first.queue_id and retry.rollout_id != first.rollout_id
    diagnostics.reset()
    assert not store.heartbeat(first.queue_id, "r", rollout_id=first.rollout_id)
    assert not store.complete(first.queue_id, "r", "succeeded", rollout_id=first.rollout_id)
    assert diagnostics.counters().get("queue_results_refused_stale_try") == 1
    (now,) = store.queue_entries([entry.group_id])
    assert now.status == QueueStatus.LEASED and now.rollout_id == retry.rollout_id and now.outcome is None
    assert store.heartbeat(retry.queue_id, "r", rollout_id=retry.rollout_id)
    assert store.complete(retry.queue_id, "r", "failed", rollout_id=retry.rollout_id)
    assert store.complete(retry.queue_id, "r", "failed", rollout_id=retry.rollout_id)  # a retried request: yes
    assert not store.complete(retry.queue_id, "r", "failed", rollout_id=first.rollout_id)  # the old try: no
    (done,) = store.queue_entries([entry.group_id])
    assert done.status == QueueStatus.DONE and done.outcome == RolloutStatus.FAILED and done.rollout_id == retry.rollout_id
    store.flush()
    assert store.get_rollout(first.rollout_id).status == RolloutStatus.TIMED_OUT


@pytest.mark.parametrize("bad, named", [("3f2a", "a list of queue ids"), ([1], "a list of queue ids"),
                                        (None, "a list of queue ids"), ([""], "a list of queue ids")])
def test_cancel_refuses_what_is_not_a_list_of_queue_ids(store, bad, named):
    (entry,) = store.enqueue({"q": 1}, n=1)
    with pytest.raises(lrl.ConfigurationError, match=named) as err:
        store.cancel(bad)
    assert repr(bad)[:20] in str(err.value) and "cancel([" in str(err.value)  # the value and the fix
    with pytest.raises(lrl.ConfigurationError, match="reason"):
        store.cancel([entry.queue_id], reason=7)
    assert _statuses(store, entry.group_id) == {entry.queue_id: "queued"}
