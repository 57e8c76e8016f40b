"""The store is a few small protocols (``store/protocols.py``): every store implements each one, with the
protocol's own signatures, and what is written once over them (``store/queries.py``: trajectories, samples,
id prefixes, the idle sweep, waiting for groups) answers the same over every store."""

from __future__ import annotations

import inspect
import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import Reward, RewardSource, RolloutStatus
from lightning_rl.store import (InMemoryStore, PolicyLog, RewardLog, RolloutIndex, RolloutReader, SpanSink, SQLiteStore,
                                Store, TaskQueue, policy_versions, resolve_rollout_id, wait_for_groups)
from lightning_rl.store.http.client import HttpStore

from .helpers import llm_span, rollout

PROTOCOLS = (SpanSink, RolloutReader, RolloutIndex, RewardLog, TaskQueue, PolicyLog, Store)


def _members(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(value) for klass in protocol.__mro__ if klass not in (object,)
            for name, value in vars(klass).items() if callable(value) and (not name.startswith("_") or name in
                                                                            ("__enter__", "__exit__"))
            and klass.__module__.startswith("lightning_rl")}


def _shape(signature: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def test_every_store_implements_every_protocol(store):
    for protocol in PROTOCOLS:
        assert isinstance(store, protocol), protocol.__name__


@pytest.mark.parametrize("cls", [SQLiteStore, InMemoryStore, HttpStore])
def test_every_store_method_has_its_protocols_signature(cls):
    members = _members(Store)
    assert {"add_reward", "enqueue", "get_rollout", "last_activity", "record_policy", "start_rollout"} <= set(members)
    for name, signature in members.items():
        assert _shape(inspect.signature(getattr(cls, name))) == _shape(signature), f"{cls.__name__}.{name}"



def _fill(store) -> float:
    now = time.time()
    store.start_rollout(rollout("alpha-1", start_time=now - 30))
    store.add_spans([llm_span("alpha-1", 0, 0, [1, 2], [3], agent="writer"),
                     llm_span("alpha-1", 1, 1, [1, 2, 3, 4], [5], agent="critic")])
    store.write_reward(Reward(rollout_id="alpha-1", value=1.0, source=RewardSource.RETURNED, time=now - 20))
    store.finish_rollout("alpha-1", RolloutStatus.SUCCEEDED, now - 20, None)
    store.start_rollout(rollout("alpha-2", start_time=now - 10))  # nothing reached it
    store.start_rollout(rollout("beta", start_time=now - 5))
    store.add_spans([llm_span("beta", 0, 0, [7], [8], agent="writer", source="missing")])
    store.record_policy("policy", 3)
    store.flush()
    return now


def test_the_queries_answer_the_same_over_every_store(store):
    now = _fill(store)
    (traj,) = [t for t in lrl.trajectories(store, agent="critic")]
    assert traj.rollout_id == "alpha-1" and traj.final_reward == 1.0 and [c.agent_name for c in traj.llm_calls] == [
        "writer", "critic"]
    assert lrl.trajectory(store, "alpha-1") == traj
    assert [t.rollout_id for t in lrl.trajectories(store, status="running")] == ["alpha-2", "beta"]
    samples, stats = lrl.samples(store, agents=["writer"])
    assert [(s.rollout_id, s.response_ids) for s in samples] == [("alpha-1", [3])] and stats.samples == 1

    assert [r.rollout_id for r, _, _ in store.rollout_data(["beta", "alpha-1"])] == ["beta", "alpha-1"]
    with pytest.raises(lrl.RolloutNotFoundError, match="'nope'"):
        list(store.rollout_data(["alpha-1", "nope"]))
    assert store.existing_rollout_ids(["alpha-1", "nope", "beta"]) == {"alpha-1", "beta"}
    assert store.rollout_ids_with_prefix("alpha", 11) == ["alpha-1", "alpha-2"]
    assert store.rollout_ids_with_prefix("alpha", 1) == ["alpha-1"]
    assert store.llm_call_counts(["alpha-1", "alpha-2", "beta", "nope"]) == {"alpha-1": 2, "alpha-2": 0, "beta": 1}
    assert store.last_activity("alpha-2") is None and store.last_activity("nope") is None
    assert store.last_activity("alpha-1") == pytest.approx(now - 20)  # the reward came after its spans ended

    assert resolve_rollout_id(store, "alpha-1") == "alpha-1"
    assert resolve_rollout_id(store, "be") == "beta"
    with pytest.raises(lrl.ConfigurationError, match="starts 2 rollout ids: alpha-1, alpha-2"):
        resolve_rollout_id(store, "alpha")
    with pytest.raises(lrl.RolloutNotFoundError, match="nor one starting with it"):
        resolve_rollout_id(store, "gamma")
    assert policy_versions(store) == {"policy": 3}


def test_waiting_for_groups_reads_the_queue(store):
    (entry,) = store.enqueue({"q": 1})
    assert not wait_for_groups(store, [entry.group_id], timeout=0.2)
    (leased,) = store.lease("runner-1")
    assert store.complete(leased.queue_id, "runner-1", "succeeded")
    assert wait_for_groups(store, [entry.group_id], timeout=5)
    assert wait_for_groups(store, ["no-such-group"], timeout=0)
