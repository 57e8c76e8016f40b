"""Policy versions live in the store: every publish is recorded, a rollout's version comes from its
calls when it ends, and pollers read rewards by position (what is new, not the whole history)."""

from __future__ import annotations

import re
import sqlite3
import time

import httpx
import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.records import RolloutStatus
from lightning_rl.store import policy_versions
from lightning_rl.store.http.client import HttpStore
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.store.sqlite.store import SQLiteStore

from .helpers import rollout


def test_publishes_are_recorded_and_the_latest_one_is_live(store):
    assert policy_versions(store) == {}
    store.record_policy("policy", 0, adapter="/adapters/v00000", time=10.0)
    store.record_policy("policy", 1, adapter="/adapters/v00001", time=20.0)
    store.record_policy("critic", 5, time=15.0)
    store.record_policy("policy", 0, adapter="/adapters/v00000", time=30.0)  # a new run started over
    assert policy_versions(store) == {"policy": 0, "critic": 5}
    history = store.policies("policy")
    assert [(p.version, p.adapter, p.time) for p in history] == [
        (0, "/adapters/v00000", 10.0), (1, "/adapters/v00001", 20.0), (0, "/adapters/v00000", 30.0)]
    assert store.latest_policies()["critic"].time == 15.0


def test_a_publish_keeps_the_versioned_name_every_replica_serves_it_under(store):
    store.record_policy("policy", 4, adapter="/adapters/v00004", time=10.0)
    store.record_policy("policy", 5, adapter="/adapters/v00005", time=20.0, served_as="policy@v5")
    assert [p.served_as for p in store.policies("policy")] == [None, "policy@v5"]
    assert store.latest_policies()["policy"].served_as == "policy@v5"
    for bad in ("policy", "", 5):  # the stable name itself, nothing, not a name
        with pytest.raises(ConfigurationError, match="served_as must be the version's own served name"):
            store.record_policy("policy", 6, served_as=bad)
    assert store.latest_policies()["policy"].version == 5


@pytest.mark.parametrize("name, version, fix", [("", 1, "served_name"), ("policy", -1, "an int >= 0"),
                                                 ("policy", True, "an int >= 0"), (None, 1, "served_name")])
def test_a_bad_publish_is_refused_by_name(store, name, version, fix):
    store.record_policy("policy", 3)
    with pytest.raises(ConfigurationError, match=fix):
        store.record_policy(name, version)
    assert policy_versions(store) == {"policy": 3}  # nothing recorded is lost


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
        assert policy_versions(s) == {"policy": 7}


def test_a_publish_records_the_groups_it_was_trained_on(store):
    assert store.record_policy("policy", 0, time=10.0).trained_on is None  # version 0: trained on nothing yet
    groups = ["g-7", "g-2", "g-10", "g-2b"]  # batch order, not sorted order
    made = store.record_policy("policy", 1, adapter="/adapters/v00001", time=20.0, trained_on=groups)
    groups.append("added-later")  # the caller's list is not the record's
    assert made.trained_on == ["g-7", "g-2", "g-10", "g-2b"]
    made.trained_on.append("mutated")  # nor is the returned record the stored one
    store.record_policy("critic", 3, time=15.0, trained_on=("c-1", "c-0"))  # a tuple is taken, read back as a list
    store.record_policy("critic", 4, time=25.0, trained_on=[])  # recorded as empty: not the same as unknown
    history = store.policies("policy")
    assert [(p.version, p.trained_on) for p in history] == [(0, None), (1, ["g-7", "g-2", "g-10", "g-2b"])]
    history[1].trained_on.append("mutated")  # what a reader does to its copy stays with it
    assert [p.trained_on for p in store.policies()] == [None, ["g-7", "g-2", "g-10", "g-2b"], ["c-1", "c-0"], []]
    latest = store.latest_policies()
    assert latest["policy"].trained_on == ["g-7", "g-2", "g-10", "g-2b"] and latest["critic"].trained_on == []
    assert policy_versions(store) == {"policy": 1, "critic": 4}


@pytest.mark.parametrize("bad, shown_as", [
    ("g-1", "'g-1'"),  # one id, not a list of them: a str is a Sequence[str] too, so it is named
    (["g-1", ""], "''"),
    (["g-1", 3], "3"),
    ([None], "None"),
    ({"g-1"}, "{'g-1'}"),
    (7, "7"),
])
def test_a_bad_trained_on_is_refused_naming_the_value(store, bad, shown_as):
    store.record_policy("policy", 3, trained_on=["g-0"])
    with pytest.raises(ConfigurationError, match="trained_on.*" + re.escape(shown_as)):
        store.record_policy("policy", 4, trained_on=bad)
    assert [(p.version, p.trained_on) for p in store.policies()] == [(3, ["g-0"])]  # nothing half-recorded


def test_trained_on_is_optional_over_http(tmp_path):
    with BackgroundServer(tmp_path / "served.db") as server:
        with httpx.Client(base_url=server.url + "/v1") as http:
            old = http.post("/policies", json={"served_name": "policy", "version": 2, "adapter": None, "time": 5.0})
            assert old.status_code == 200 and old.json()["trained_on"] is None
            new = http.post("/policies", json={"served_name": "policy", "version": 3, "trained_on": ["g-b", "g-a"]})
            assert new.status_code == 200 and new.json()["trained_on"] == ["g-b", "g-a"]
            refused = http.post("/policies", json={"served_name": "policy", "version": 4, "trained_on": ["g-a", ""]})
            assert refused.status_code == 422 and "trained_on" in refused.text
            listed = http.get("/policies").json()
            assert [p["trained_on"] for p in listed] == [None, ["g-b", "g-a"]]
        with HttpStore(server.url, spill_dir=tmp_path / "spill", retry_for=5.0) as client:
            assert [(p.version, p.trained_on) for p in client.policies()] == [(2, None), (3, ["g-b", "g-a"])]
