"""The SQLite store's reads, in SQL: each function takes a connection its caller holds (under its lock).

The questions ``RolloutIndex`` asks are answered here without reading spans' token columns or whole
records: id prefixes by a range of the primary key, LLM calls by ``json_extract``, the last activity
by two ``max()``, existence in chunks; the rollout page filters and sorts on the rollouts' own columns.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence

import orjson

from ... import semconv
from ...records import PolicyDecision, PolicyRecord, Reward, Rollout, RolloutPage, RolloutQuery, Span
from ..kit import rollout_sql
from ..rows import (
    DECISION_COLUMNS,
    decision_from_row,
    REWARD_COLUMNS,
    ROLLOUT_COLUMNS,
    SPAN_COLUMNS,
    reward_from_values,
    rollouts_from_rows,
    spans_from_rows,
)

_ROLLOUT = f"SELECT {', '.join(ROLLOUT_COLUMNS)} FROM rollouts"
_SPANS = f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans WHERE rollout_id = ? ORDER BY seq"
_REWARDS = f"SELECT {', '.join(REWARD_COLUMNS)} FROM rewards WHERE rollout_id = ? ORDER BY reward_id"
_IN_CHUNK = 500  # ids per IN (...) list
_LLM_OPS = ", ".join(f"'{op}'" for op in sorted(semconv.LLM_OPERATIONS))


def _chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(ids), _IN_CHUNK):
        yield ids[start:start + _IN_CHUNK]


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" * len(values))


def get_rollout(conn: sqlite3.Connection, rollout_id: str) -> Rollout | None:
    found = rollouts_from_rows(conn.execute(f"{_ROLLOUT} WHERE rollout_id = ?", (rollout_id,)).fetchall())
    return found[0] if found else None


def spans_of(conn: sqlite3.Connection, rollout_id: str) -> list[Span]:
    return spans_from_rows(conn.execute(_SPANS, (rollout_id,)).fetchall())


def rewards_of(conn: sqlite3.Connection, rollout_id: str) -> list[Reward]:
    return [reward_from_values(r) for r in conn.execute(_REWARDS, (rollout_id,)).fetchall()]


def query_rollouts(conn: sqlite3.Connection, *, mode: str | None, status: str | None, since: float | None,
                   min_policy_version: int | None, limit: int | None, newest_first: bool) -> list[Rollout]:
    st = rollout_sql.rollouts_statement(rollout_sql.SQLITE, mode=mode, status=status, since=since,
                                        min_policy_version=min_policy_version, limit=limit, newest_first=newest_first)
    return rollouts_from_rows(conn.execute(st.sql, st.params).fetchall())


def rollout_page(conn: sqlite3.Connection, query: RolloutQuery) -> RolloutPage:
    """Filters and sorts on the rollouts' own columns (indexed by mode, start and reward; ``kit/rollout_sql.py``)."""
    count, rows = rollout_sql.page_statements(rollout_sql.SQLITE, query)
    total = conn.execute(count.sql, count.params).fetchone()[0]
    return rollout_sql.page_from_rows(conn.execute(rows.sql, rows.params).fetchall(), total)


def existing_ids(conn: sqlite3.Connection, rollout_ids: Iterable[str]) -> set[str]:
    found: set[str] = set()
    for chunk in _chunks(list(rollout_ids)):
        rows = conn.execute(f"SELECT rollout_id FROM rollouts WHERE rollout_id IN ({_marks(chunk)})", chunk)
        found.update(r[0] for r in rows.fetchall())
    return found


def ids_with_prefix(conn: sqlite3.Connection, prefix: str, limit: int) -> list[str]:
    rows = conn.execute("SELECT rollout_id FROM rollouts WHERE rollout_id >= ? AND rollout_id < ? ORDER BY rollout_id "
                        "LIMIT ?", (prefix, prefix + "\U0010ffff", int(limit))).fetchall()
    return [r[0] for r in rows]


def llm_call_counts(conn: sqlite3.Connection, rollout_ids: Sequence[str]) -> dict[str, int]:
    ids = list(rollout_ids)
    counts = dict.fromkeys(existing_ids(conn, ids), 0)
    for chunk in _chunks(ids):
        rows = conn.execute(
            f"SELECT rollout_id, count(*) FROM spans WHERE rollout_id IN ({_marks(chunk)}) "
            "AND CASE WHEN json_valid(attributes) THEN json_extract(attributes, '$.\"gen_ai.operation.name\"') END "
            f"IN ({_LLM_OPS}) GROUP BY rollout_id", chunk).fetchall()
        counts.update({rid: n for rid, n in rows})
    return counts


def last_activity(conn: sqlite3.Connection, rollout_id: str) -> float | None:
    """Without reading the spans' token columns (the gateway's orphan sweep asks every minute)."""
    (span_end,), = conn.execute("SELECT max(end_ns) FROM spans WHERE rollout_id = ?", (rollout_id,)).fetchall()
    (reward_time,), = conn.execute("SELECT max(time) FROM rewards WHERE rollout_id = ?", (rollout_id,)).fetchall()
    times = [t for t in ((span_end / 1e9) if span_end is not None else None, reward_time) if t is not None]
    return max(times) if times else None


def rewards_after(conn: sqlite3.Connection, after: int, name: str | None, limit: int) -> list[tuple[int, str]]:
    """``(position, rollout_id)`` of rewards stored after position ``after``, in order."""
    sql, params = "SELECT reward_id, rollout_id FROM rewards WHERE reward_id > ?", [after]
    if name is not None:
        sql += " AND name = ?"
        params.append(name)
    return [tuple(r) for r in conn.execute(sql + " ORDER BY reward_id LIMIT ?", (*params, int(limit))).fetchall()]


def query_policies(conn: sqlite3.Connection, served_name: str | None, *, latest: bool = False) -> list[PolicyRecord]:
    """In publish order; ``latest``: only the last publish of each name."""
    where, params = [], []
    if served_name is not None:
        where, params = ["served_name = ?"], [served_name]
    if latest:
        where.append("publish_id IN (SELECT max(publish_id) FROM policies GROUP BY served_name)")
    sql = "SELECT served_name, version, adapter, time, trained_on, served_as FROM policies"
    if where:
        sql += " WHERE " + " AND ".join(where)
    rows = conn.execute(sql + " ORDER BY publish_id", params).fetchall()
    return [PolicyRecord(served_name=n, version=v, adapter=a, time=t, trained_on=None if g is None else orjson.loads(g),
                         served_as=s) for n, v, a, t, g, s in rows]


def query_decisions(conn: sqlite3.Connection, served_name: str | None, *, latest: bool = False) -> list[PolicyDecision]:
    """In the order they were recorded; ``latest``: only the last decision about each name."""
    where, params = [], []
    if served_name is not None:
        where, params = ["served_name = ?"], [served_name]
    if latest:
        where.append("decision_id IN (SELECT max(decision_id) FROM decisions GROUP BY served_name)")
    sql = f"SELECT {', '.join(DECISION_COLUMNS)} FROM decisions"
    if where:
        sql += " WHERE " + " AND ".join(where)
    try:
        rows = conn.execute(sql + " ORDER BY decision_id", params).fetchall()
    except sqlite3.OperationalError as exc:  # a store of schema 11 opened read-only (the viewer never migrates)
        if "no such table" in str(exc):
            return []
        raise
    return [decision_from_row(r) for r in rows]
