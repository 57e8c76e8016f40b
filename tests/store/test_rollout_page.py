"""Store.rollout_page: the same page from the SQLite and PostgreSQL stores (SQL over the reward sums their
databases keep), the store server (HTTP) and the generic Python path (the in-memory store), for every filter
and sort."""

from __future__ import annotations

import time

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.records import Reward, RewardSource, Rollout, RolloutStatus
from lightning_rl.store.memory_store import InMemoryStore as MemoryStore
from lightning_rl.store.sqlite.store import SQLiteStore


def _fill(store) -> None:
    now = time.time() - 100
    for i in range(30):
        store.start_rollout(Rollout(rollout_id=f"r{i:02d}", name="calc", agent=("planner", "solver", None)[i % 3],
                                    task={"question": f"What is {i} + 1?", "tag": "odd" if i % 2 else "even_100%"},
                                    group_id=f"g{i // 5}", attempt=i % 5, mode=("train", "eval")[i % 2],
                                    policy_version=i % 4, start_time=now + i))
        if i % 7:  # every 7th rollout has no reward
            store.write_reward(Reward(rollout_id=f"r{i:02d}", value=(i % 5) / 4, source=RewardSource.RETURNED))
        if i % 10 == 3:  # a second reward of the same name, and one of another name (not summed)
            store.write_reward(Reward(rollout_id=f"r{i:02d}", value=0.5, source=RewardSource.FEEDBACK))
            store.write_reward(Reward(rollout_id=f"r{i:02d}", value=9.0, name="user_feedback"))
        store.finish_rollout(f"r{i:02d}", RolloutStatus.SUCCEEDED if i % 4 else RolloutStatus.FAILED, now + i + 1, None)
    store.flush()


QUERIES = [
    {}, {"descending": False}, {"mode": "eval"}, {"status": "failed"}, {"agent": "solver"}, {"group_id": "g2"},
    {"policy_version": 3}, {"reward_min": 0.5}, {"reward_max": 0.25}, {"reward_min": 0.25, "reward_max": 0.75},
    {"text": "what is 2"}, {"text": "100%"}, {"text": "r1"}, {"sort": "reward"}, {"sort": "reward", "descending": False},
    {"sort": "agent"}, {"sort": "policy_version", "offset": 5, "limit": 7}, {"offset": 25, "limit": 10},
    {"mode": "train", "sort": "reward", "reward_min": 0.0, "limit": 3},
]


def _shape(page):
    return page.total, [(row.rollout.rollout_id, row.reward, row.rewards) for row in page.rows]


def _sql_store(kind, request, tmp_path):
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "s.db")
    from lightning_rl.store.postgres.store import PostgresStore

    return PostgresStore(request.getfixturevalue("pg_url"))


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_sql_and_the_generic_path_agree(request, tmp_path, kind):
    sql, memory = _sql_store(kind, request, tmp_path), MemoryStore()
    for store in (sql, memory):
        _fill(store)
    for query in QUERIES:
        got = _shape(sql.rollout_page(**query))
        assert got == _shape(memory.rollout_page(**query)), query
        if not query:
            assert got[0] == 30 and len(got[1]) == 30 and got[1][0][0] == "r29"  # newest first
            assert dict((rid, (reward, n)) for rid, reward, n in got[1])["r03"] == (1.25, 2)  # 0.75 + 0.5, not 9
            assert dict((rid, (reward, n)) for rid, reward, n in got[1])["r07"] == (None, 0)
    sql.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_reward_sums_the_database_keeps_stay_right(request, tmp_path, kind):
    """A reward stored twice (a retried batch) is summed once; a reward that reaches the store before its
    rollout's row (a replayed spill) is summed when the row comes; late feedback adds; other names do not."""
    store = _sql_store(kind, request, tmp_path)
    early = Reward(rollout_id="late-row", value=0.25, source=RewardSource.RETURNED)
    store.write_reward(early)
    store.flush()
    store.start_rollout(Rollout(rollout_id="late-row", name="calc", task={}, start_time=time.time()))
    store.start_rollout(Rollout(rollout_id="r", name="calc", task={}, start_time=time.time()))
    store.flush()
    twice = Reward(rollout_id="r", value=0.5, source=RewardSource.RETURNED)
    for reward in (twice, twice, Reward(rollout_id="r", value=7.0, name="user_feedback"), early):
        store.write_reward(reward)
    store.flush()
    store.add_reward("r", 0.25)  # late feedback
    page = {row.rollout.rollout_id: (row.reward, row.rewards) for row in store.rollout_page().rows}
    assert page == {"late-row": (0.25, 1), "r": (0.75, 2)}
    assert [row.rollout.rollout_id for row in store.rollout_page(sort="reward").rows] == ["r", "late-row"]
    store.close()


def test_the_store_server_answers_the_same_page(tmp_path):
    pytest.importorskip("fastapi")
    from lightning_rl.store.http.client import HttpStore
    from lightning_rl.store.http.server import BackgroundServer

    with BackgroundServer(tmp_path / "s.db") as server:
        _fill(server.store)
        remote = HttpStore(server.url)
        for query in QUERIES:
            assert _shape(remote.rollout_page(**query)) == _shape(server.store.rollout_page(**query))
        remote.close()


def test_a_bad_query_names_the_field():
    with pytest.raises(ConfigurationError, match="sort must be one of start_time, reward"):
        MemoryStore().rollout_page(sort="price")
    with pytest.raises(ConfigurationError, match="limit"):
        MemoryStore().rollout_page(limit=0)
