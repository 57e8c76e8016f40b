"""The task queue contract: groups, leases, heartbeats, expiry and retries, outcomes (both stores)."""

from __future__ import annotations

import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import QueueStatus, RolloutStatus
from lightning_rl.store import wait_for_groups


def test_enqueue_makes_a_group_of_n_tries(store):
    entries = store.enqueue({"q": "2+2"}, n=4)
    assert len({e.group_id for e in entries}) == 1 and [e.attempt for e in entries] == [0, 1, 2, 3]
    assert {e.status for e in store.queue_entries()} == {QueueStatus.QUEUED}
    with pytest.raises(ValueError, match="at least once"):
        store.enqueue("x", n=0)


def test_lease_is_exclusive_and_complete_needs_the_lease(store):
    store.enqueue("t", n=3)
    a = store.lease("runner-a", limit=2)
    b = store.lease("runner-b", limit=5)
    assert len(a) == 2 and len(b) == 1
    assert {e.queue_id for e in a}.isdisjoint({e.queue_id for e in b})
    assert all(e.rollout_id and e.tries == 1 for e in a + b)
    assert store.lease("runner-c") == []
    assert not store.complete(a[0].queue_id, "runner-b", "succeeded")  # not b's lease
    assert store.complete(a[0].queue_id, "runner-a", "succeeded")
    assert not wait_for_groups(store, [a[0].group_id], timeout=0.1)
    for e in a[1:]:
        store.complete(e.queue_id, "runner-a", "failed")
    store.complete(b[0].queue_id, "runner-b", "succeeded")
    assert wait_for_groups(store, [a[0].group_id], timeout=1)
    assert sorted(e.outcome for e in store.queue_entries()) == ["failed", "succeeded", "succeeded"]


def test_expired_lease_is_retried_and_the_partial_attempt_kept_as_timed_out(store):
    previous = lrl.tracer.tracing._sink
    lrl.configure(store=store)
    try:
        (entry,) = store.enqueue({"q": 1}, n=1)
        (first,) = store.lease("doomed", lease_seconds=0.2)

        @lrl.trace
        def agent(task):
            lrl.emit_reward(0.5)
            return 1.0

        # the doomed runner started its rollout and died before finishing it
        store.start_rollout(lrl.Rollout(rollout_id=first.rollout_id, task={"q": 1}, group_id=first.group_id))
        store.flush()
        time.sleep(0.3)
        (retry,) = store.lease("healthy", lease_seconds=10)
        assert retry.queue_id == entry.queue_id and retry.tries == 2 and retry.rollout_id != first.rollout_id
        assert not store.heartbeat(first.queue_id, "doomed")  # the dead runner lost its lease
        with lrl.rollout_overrides(rollout_id=retry.rollout_id, group_id=retry.group_id, attempt=retry.attempt):
            agent(retry.task)
        assert store.complete(retry.queue_id, "healthy", "succeeded")
        store.flush()
        partial = store.get_rollout(first.rollout_id)
        assert partial.status == RolloutStatus.TIMED_OUT and "lease" in partial.error
        assert store.get_rollout(retry.rollout_id).status == RolloutStatus.SUCCEEDED
        samples_from = {t.rollout_id for t in lrl.trajectories(store, status="succeeded")}
        assert samples_from == {retry.rollout_id}  # the partial attempt is not mixed in
    finally:
        lrl.tracer.tracing.set_sink(previous)


def test_too_many_expired_tries_end_timed_out(store):
    store.enqueue("t", n=1, max_tries=2)
    for _ in range(2):
        assert store.lease("r", lease_seconds=0.05)
        time.sleep(0.1)
    assert store.lease("r") == []
    (entry,) = store.queue_entries()
    assert entry.status == QueueStatus.DONE and entry.outcome == RolloutStatus.TIMED_OUT


def test_heartbeat_keeps_a_lease_alive(store):
    store.enqueue("t", n=1)
    (e,) = store.lease("r", lease_seconds=0.3)
    for _ in range(4):
        time.sleep(0.1)
        assert store.heartbeat(e.queue_id, "r", lease_seconds=0.3)
    assert store.lease("other") == []


def test_enqueue_once_is_idempotent_for_a_group(store):
    first = store.enqueue({"q": 1}, n=3, group_id="g-1", once=True)
    again = store.enqueue({"q": 1}, n=3, group_id="g-1", once=True)  # a retried request
    assert [e.queue_id for e in again] == [e.queue_id for e in first] and len(store.queue_entries(["g-1"])) == 3


@pytest.mark.parametrize("started", ["never", "after expiry", "finished before expiry"])
def test_an_expired_try_stays_timed_out_whatever_its_agent_reports(store, started):
    (entry,) = store.enqueue({"q": 1}, n=1)
    (first,) = store.lease("slow", lease_seconds=0.1)
    late = lrl.Rollout(rollout_id=first.rollout_id, task={"q": 1}, group_id=first.group_id)
    if started == "finished before expiry":  # the agent succeeded, its runner missed the lease
        store.start_rollout(late)
        store.finish_rollout(first.rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)
        store.flush()
    time.sleep(0.2)
    (retry,) = store.lease("other", lease_seconds=10)
    store.flush()
    if started == "after expiry":  # the agent starts only now, and succeeds
        store.start_rollout(late)
        store.finish_rollout(first.rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)
        store.flush()
    expired = store.get_rollout(first.rollout_id)  # never started: a timed_out row all the same
    assert expired.status == RolloutStatus.TIMED_OUT and "lease" in expired.error
    assert retry.rollout_id != first.rollout_id
    assert [r.rollout_id for r in store.rollouts(status="succeeded")] == []


def test_a_queued_try_carries_the_endpoint_and_sampling_its_runner_runs_it_with(store):
    """What verl's external rollouts queue: the runner's agent calls that endpoint, sampled as verl samples."""
    from lightning_rl.trainer_bridge.runner import Runner

    overrides = {"endpoint": ("http://10.0.0.7:8000/v1", "policy"), "sampling": {"temperature": 0.7, "top_k": -1}}
    (entry,) = store.enqueue({"q": 1}, n=1, overrides=overrides)
    assert entry.overrides == {"endpoint": ["http://10.0.0.7:8000/v1", "policy"], "sampling": {"temperature": 0.7,
                                                                                               "top_k": -1}}
    (plain,) = store.enqueue({"q": 2}, n=1)
    seen = {}

    def agent(task):
        seen[task["q"]] = lrl.current_endpoint()

    runner = Runner(store, agent, concurrency=2, rollout_timeout=10)
    try:
        runner.run_until_done([entry.group_id, plain.group_id])
    finally:
        runner.close()
    assert seen == {1: ("http://10.0.0.7:8000/v1", "policy"), 2: None}
    (done,) = store.queue_entries([entry.group_id])
    assert done.overrides == entry.overrides and done.outcome == "succeeded"
    for bad, named in (({"endpoint": "http://x/v1"}, "endpoint"), ({"sampling": {"temperature": "hot"}}, "sampling"),
                       ({"model": "x"}, "keys among")):
        with pytest.raises(lrl.ConfigurationError, match=named):
            store.enqueue({"q": 3}, n=1, overrides=bad)


def test_a_try_without_overrides_is_sent_as_before_to_older_runners():
    from lightning_rl.records import QueueEntry
    from lightning_rl.store import wire

    entry = QueueEntry(queue_id="q", group_id="g")
    assert "overrides" not in wire.queue_entry_json(entry)
    given = entry.model_copy(update={"overrides": {"endpoint": ["http://h/v1", "m"]}})
    assert wire.queue_entry_json(given)["overrides"] == {"endpoint": ["http://h/v1", "m"]}
