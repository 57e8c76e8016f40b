"""Sample sources without a server: the staleness setting, and how a replay cuts a stored run into batches."""

from __future__ import annotations

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.store.sqlite_store import SQLiteStore
from lightning_rl.trainer_bridge.sources import LiveGroups, StoredGroups
from lightning_rl.trainer_bridge.trainer import Trainer


def test_max_staleness_needs_overlap_and_a_count(tmp_path):
    store = SQLiteStore(tmp_path / "s.db")
    common = dict(agent=lambda task: None, tasks=[{}], store=store, model_dir=".", server_url="http://127.0.0.1:9",
                  out_dir=tmp_path)
    with pytest.raises(ConfigurationError, match="max_staleness=2 .*overlap=True"):
        Trainer(max_staleness=2, **common)
    with pytest.raises(ConfigurationError, match="int >= 0.*-1"):
        Trainer(overlap=True, max_staleness=-1, **common)
    assert Trainer(overlap=True, **common).max_staleness == 1
    assert Trainer(**common).max_staleness == 0
    with pytest.raises(ConfigurationError, match="agent to run"):
        Trainer(**{**common, "agent": None})
    with pytest.raises(ConfigurationError, match="worker processes"):
        LiveGroups(store, [{}], n=2, tasks_per_step=1, steps=1, max_staleness=1, run_now=lambda groups: None)
    store.close()


def test_live_groups_queue_max_staleness_plus_one_steps_ahead(tmp_path):
    store = SQLiteStore(tmp_path / "s.db")
    live = LiveGroups(store, [{"t": i} for i in range(5)], n=2, tasks_per_step=3, steps=4, max_staleness=1,
                      work=lambda: None)
    live.start()
    assert len(store.queue_entries()) == 2 * 3 * 2  # two steps of 3 groups of 2 tries
    live.published(1)
    assert len(store.queue_entries()) == 3 * 3 * 2
    live.published(3)
    assert len(store.queue_entries()) == 4 * 3 * 2  # never more than the run's steps
    store.close()


def test_replay_batches_come_from_lineage_else_from_queue_order(tmp_path):
    store = SQLiteStore(tmp_path / "s.db")
    groups = [store.enqueue({"t": i}, n=2)[0].group_id for i in range(5)]
    with pytest.raises(ConfigurationError, match="tasks-per-step"):
        StoredGroups(store)
    assert StoredGroups(store, tasks_per_step=2).batches == [groups[:2], groups[2:4], groups[4:]]
    assert StoredGroups(store, tasks_per_step=2, steps=1).batches == [groups[:2]]
    store.record_policy("planner", 0)
    for name in ("planner", "solver"):  # a team's step publishes each policy it updated: one batch
        store.record_policy(name, 1, trained_on=[groups[3], groups[0]])
    store.record_policy("planner", 2, trained_on=[groups[1]])
    replay = StoredGroups(store)
    assert replay.from_lineage and replay.batches == [[groups[3], groups[0]], [groups[1]]]
    store.close()


def test_replay_of_an_empty_store_says_so(tmp_path):
    store = SQLiteStore(tmp_path / "empty.db")
    with pytest.raises(ConfigurationError, match="no training groups to replay"):
        StoredGroups(store, tasks_per_step=2)
    store.close()
