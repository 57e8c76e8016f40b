"""Sample sources without a server: the staleness setting, how a replay cuts a stored run into batches, and
the production stream's batches, bounded state and resumption."""

from __future__ import annotations

import time

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.records import Mode, RolloutStatus
from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.trainer_bridge.sources import LiveGroups, ProductionStream, StoredGroups
from lightning_rl.trainer_bridge.trainer import Trainer

from ..store.helpers import llm_span, rollout


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


def _prod_rollout(store, rid: str, version: int, reward: float | None = 1.0) -> None:
    """A finished production rollout whose one call was served by ``version`` of "policy"."""
    store.start_rollout(rollout(rid, mode=Mode.PROD))
    store.add_spans([llm_span(rid, 0, 0, [1, 2, 3], [4, 5], model="policy", policy_version=version)])
    store.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)
    if reward is not None:
        store.add_reward(rid, reward)


def _stream(store, path, **kw) -> ProductionStream:
    return ProductionStream(store, state_path=path / "state.json", min_new=2, max_policy_lag=1, **kw)


def test_production_stream_batches_rewarded_prod_rollouts_and_its_state_stays_bounded(tmp_path):
    store = SQLiteStore(tmp_path / "s.db")
    stream = _stream(store, tmp_path)
    stream.start()
    stream.published(0)
    _prod_rollout(store, "r0", 0)
    _prod_rollout(store, "unrewarded", 0, reward=None)
    assert stream.poll() is None and stream.last_check["waiting"] == 1
    _prod_rollout(store, "r1", 0)
    batch = stream.poll()
    assert batch.group_ids == ["r0", "r1"] and [[t.rollout_id for t in g] for g in batch.groups] == [["r0"], ["r1"]]
    assert len(batch.samples) == 2 and batch.metrics["rollouts"] == 2 and batch.metrics["train_reward"] == 1.0
    stream.published(1)
    assert set(stream.state["used"]) == {"r0", "r1"} and stream.state["taking"] == []
    sizes = []
    for version in range(1, 31):  # 30 more updates: the state keeps only what could still be trained on
        for k in range(2):
            _prod_rollout(store, f"v{version}-{k}", version)
        assert stream.poll() is not None
        stream.published(version + 1)
        sizes.append((tmp_path / "state.json").stat().st_size)
    assert set(stream.state["used"]) == {"v30-0", "v30-1"}  # served at 31 - max_policy_lag or later
    assert sizes[-1] - sizes[5] < 20  # the same few ids and publish times, however long it runs
    store.add_reward("r0", 0.0)  # feedback changed long after: too stale now, dropped and counted, not trained again
    assert stream.poll() is None and stream.last_check["dropped_stale"] == 1
    store.close()


@pytest.mark.parametrize("published", [True, False])
def test_production_stream_stopped_between_publish_and_save_neither_goes_back_nor_trains_twice(tmp_path, published):
    store = SQLiteStore(tmp_path / "s.db")
    stream = _stream(store, tmp_path)
    stream.start()
    store.record_policy("policy", 0)
    stream.published(0)
    for rid in ("a", "b"):
        _prod_rollout(store, rid, 0)
    batch = stream.poll()
    assert batch.group_ids == ["a", "b"]
    if published:  # the update's weights went live and were recorded; the trainer stopped before published()
        store.record_policy("policy", 1)
    again = _stream(store, tmp_path)
    again.start()
    if published:
        assert again.version == 1 and set(again.state["used"]) == {"a", "b"}
        assert again.poll() is None and again.last_check["waiting"] == 0  # not trained on twice
    else:  # the update never went live: its batch is trained on again, by the restarted trainer
        assert again.version == 0 and set(again.waiting) == {"a", "b"}
        assert again.poll().group_ids == ["a", "b"]
    store.close()


def test_production_stream_settings_are_checked(tmp_path):
    store = SQLiteStore(tmp_path / "s.db")
    with pytest.raises(ConfigurationError, match="min_new must be an int >= 1.*0"):
        ProductionStream(store, state_path=tmp_path / "x.json", min_new=0)
    with pytest.raises(ConfigurationError, match="max_policy_lag must be an int >= 0.*'2'"):
        ProductionStream(store, state_path=tmp_path / "x.json", max_policy_lag="2")
    store.close()
