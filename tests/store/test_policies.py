"""Policy versions live in the store: every publish is recorded, a rollout's version comes from its
calls when it ends, and pollers read rewards by position (what is new, not the whole history)."""

from __future__ import annotations

import sqlite3
import time

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.records import RolloutStatus
from lightning_rl.store.sqlite_store import SQLiteStore

from .helpers import rollout


def test_publishes_are_recorded_and_the_latest_one_is_live(store):
    assert store.policy_versions() == {}
    store.record_policy("policy", 0, adapter="/adapters/v00000", time=10.0)
    store.record_policy("policy", 1, adapter="/adapters/v00001", time=20.0)
    store.record_policy("critic", 5, time=15.0)
    store.record_policy("policy", 0, adapter="/adapters/v00000", time=30.0)  # a new run started over
    assert store.policy_versions() == {"policy": 0, "critic": 5}
    history = store.policies("policy")
    assert [(p.version, p.adapter, p.time) for p in history] == [
        (0, "/adapters/v00000", 10.0), (1, "/adapters/v00001", 20.0), (0, "/adapters/v00000", 30.0)]
    assert store.latest_policies()["critic"].time == 15.0


@pytest.mark.parametrize("name, version, fix", [("", 1, "served_name"), ("policy", -1, "non-negative"),
                                                 ("policy", True, "non-negative"), (None, 1, "served_name")])
def test_a_bad_publish_is_refused_by_name(store, name, version, fix):
    store.record_policy("policy", 3)
    with pytest.raises(ConfigurationError, match=fix):
        store.record_policy(name, version)
    assert store.policy_versions() == {"policy": 3}  # nothing recorded is lost


def test_a_rollout_takes_its_version_when_it_ends(store):
    store.start_rollout(rollout("r1", policy_version=4))
    store.start_rollout(rollout("r2", policy_version=4))
    store.finish_rollout("r1", RolloutStatus.SUCCEEDED, time.time(), None, 2)
    store.finish_rollout("r2", RolloutStatus.SUCCEEDED, time.time(), None)  # no LLM call: keeps its start's
    store.flush()
    assert store.get_rollout("r1").policy_version == 2 and store.get_rollout("r2").policy_version == 4
    assert [r.rollout_id for r in store.rollouts(min_policy_version=3)] == ["r2"]


def test_rewarded_since_reads_only_what_is_new(store):
    for rid in ("a", "b", "c"):
        store.start_rollout(rollout(rid))
        store.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)
    store.flush()
    ids, pos = store.rewarded_since(0)
    assert ids == [] and pos == 0
    store.add_reward("b", 1.0)
    store.add_reward("a", 0.5, name="style")
    ids, pos = store.rewarded_since(0, name="reward")
    assert ids == ["b"]
    assert store.rewarded_since(pos, name="reward") == ([], pos)
    store.add_reward("c", 0.0)
    store.add_reward("b", 1.0)
    ids, pos2 = store.rewarded_since(pos, name="reward")
    assert ids == ["c", "b"] and pos2 > pos
    with pytest.raises(ConfigurationError, match="position"):
        store.rewarded_since(-1)


def test_a_store_from_before_policies_gains_the_table(tmp_path):
    path = tmp_path / "old.db"
    SQLiteStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE policies")
    conn.execute("DELETE FROM _lightning_rl_migrations WHERE version = 4")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    with SQLiteStore(path) as s:
        s.record_policy("policy", 7)
        assert s.policy_versions() == {"policy": 7}
