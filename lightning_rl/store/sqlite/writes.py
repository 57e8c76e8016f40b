"""The SQLite store's writes: a batch of ops in one transaction, the queue's view, a publish.

Each function runs on a connection its caller holds (the writer thread's, or the queue's under its
lock); the caller begins and commits the transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from ...diagnostics import count
from ...records import PolicyDecision, PolicyRecord, QueueEntry, QueueStatus, RolloutStatus, allowed_from
from ..kit.batch import sort_ops
from ..ops import Op
from .quarantine import insert_quarantine
from ..rows import (
    DECISION_COLUMNS,
    decision_values,
    QUEUE_COLUMNS,
    REWARD_COLUMNS,
    ROLLOUT_COLUMNS,
    SPAN_COLUMNS,
    queue_from_values,
    queue_values,
    reward_values,
    rollout_values,
)
from ..tokens import PrefixSharer


def _insert(table: str, columns: Sequence[str], rows: int = 1) -> str:
    marks = "(" + ", ".join("?" * len(columns)) + ")"
    return f"INSERT OR IGNORE INTO {table} ({', '.join(columns)}) VALUES {', '.join([marks] * rows)}"


INSERT_SPAN = _insert("spans", SPAN_COLUMNS)
INSERT_ROLLOUT = _insert("rollouts", ROLLOUT_COLUMNS)
INSERT_REWARD = _insert("rewards", REWARD_COLUMNS)
# Rows per multi-row INSERT: 22 columns x 16 rows stays far below SQLite's bound-parameter limit.
_CHUNK = 16
_INSERT_SPANS_CHUNK = _insert("spans", SPAN_COLUMNS, _CHUNK)
_TIMED_OUT = RolloutStatus.TIMED_OUT.value


def _insert_spans(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    """Insert span rows with one multi-row statement per chunk. ``executemany`` steps once per row
    and Python's sqlite3 releases the GIL around every step, which makes a writer thread fight the
    agent's thread for the GIL row by row; one step per 16 rows avoids most of that."""
    full = len(rows) - len(rows) % _CHUNK
    for start in range(0, full, _CHUNK):
        conn.execute(_INSERT_SPANS_CHUNK, [v for row in rows[start:start + _CHUNK] for v in row])
    if full < len(rows):
        conn.executemany(INSERT_SPAN, rows[full:])


def apply_ops(conn: sqlite3.Connection, ops: Iterable[Op], sharer: PrefixSharer) -> list[str]:
    """Write ``ops`` in one transaction: starts, spans (prompts and messages prefix-shared by ``sharer``),
    rewards, then finishes, then the queue's expiries (its word is final), then descriptions for the
    quarantine. Returns the rollouts that finished (their shared prefixes can be forgotten)."""
    batch = sort_ops(ops)
    share = sharer.share
    rollouts = [rollout_values(r) for r in batch.rollouts]
    spans = [share(values) for values in batch.spans]
    rewards = [reward_values(r) for r in batch.rewards]
    finishes, expires, quarantined = batch.finishes, batch.expires, batch.notes
    conn.execute("BEGIN IMMEDIATE")
    try:
        if rollouts:
            conn.executemany(INSERT_ROLLOUT, rollouts)
        if spans:
            _insert_spans(conn, spans)
        if rewards:
            conn.executemany(INSERT_REWARD, rewards)
        for op in finishes:
            sources = sorted(s.value for s in allowed_from(op.status))
            cur = conn.execute(
                "UPDATE rollouts SET status = ?, end_time = ?, error = ?, policy_version = coalesce(?, policy_version) "
                f"WHERE rollout_id = ? AND status IN ({', '.join('?' * len(sources))})",
                (RolloutStatus(op.status).value, op.end_time, op.error, op.policy_version, op.rollout_id, *sources))
            if cur.rowcount == 0:
                count("rejected_status_transitions")
        for tombstone in expires:
            conn.execute(INSERT_ROLLOUT, rollout_values(tombstone))
            conn.execute("UPDATE rollouts SET status = ?, end_time = ?, error = ? WHERE rollout_id = ? AND status != ?",
                         (_TIMED_OUT, tombstone.end_time, tombstone.error, tombstone.rollout_id, _TIMED_OUT))
        for op in quarantined:
            insert_quarantine(conn, op.what, op.rollout_id, op.reason, op.payload)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return [op.rollout_id for op in finishes]


def insert_policy(conn: sqlite3.Connection, record: PolicyRecord) -> None:
    conn.execute("INSERT INTO policies (served_name, version, adapter, time, trained_on, served_as) "
                 "VALUES (?, ?, ?, ?, ?, ?)",
                 (record.served_name, record.version, record.adapter, record.time,
                  None if record.trained_on is None else orjson.dumps(record.trained_on).decode(), record.served_as))


def insert_decision(conn: sqlite3.Connection, record: PolicyDecision) -> None:
    marks = ", ".join("?" * len(DECISION_COLUMNS))
    conn.execute(f"INSERT INTO decisions ({', '.join(DECISION_COLUMNS)}) VALUES ({marks})", decision_values(record))


class QueueView:
    """The task queue's rows inside one transaction (``task_queue.QueueView``)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def select(self, *, status: Sequence[QueueStatus], group_ids: Sequence[str] | None = None,
               queue_id: str | None = None, limit: int | None = None) -> list[QueueEntry]:
        statuses = [str(getattr(x, "value", x)) for x in status]
        sql = f"SELECT {', '.join(QUEUE_COLUMNS)} FROM queue WHERE status IN ({', '.join('?' * len(statuses))})"
        params: list[Any] = list(statuses)
        if group_ids is not None:
            sql += f" AND group_id IN ({', '.join('?' * len(group_ids))})"
            params += list(group_ids)
        if queue_id is not None:
            sql += " AND queue_id = ?"
            params.append(queue_id)
        sql += " ORDER BY created, attempt"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [queue_from_values(r) for r in self.conn.execute(sql, params).fetchall()]

    def put(self, entries: Iterable[QueueEntry]) -> None:
        rows = [queue_values(e) for e in entries]
        if rows:
            self.conn.executemany(
                f"INSERT OR REPLACE INTO queue ({', '.join(QUEUE_COLUMNS)}) VALUES ({', '.join('?' * len(QUEUE_COLUMNS))})",
                rows)

    # on the indexes of migration 14: the rows asked for only, however many are leased
    def expired(self, now: float) -> list[QueueEntry]:
        return [queue_from_values(r) for r in self.conn.execute(
            f"SELECT {', '.join(QUEUE_COLUMNS)} FROM queue WHERE status = 'leased' AND lease_expires < ? "
            "ORDER BY lease_expires", (now,)).fetchall()]

    def held(self, runner: str, key: str) -> list[QueueEntry]:
        # sorted here: an ORDER BY would have SQLite walk (status, created, attempt) over every leased row
        return sorted((queue_from_values(r) for r in self.conn.execute(
            f"SELECT {', '.join(QUEUE_COLUMNS)} FROM queue WHERE status = 'leased' AND runner = ? AND lease_key = ?",
            (runner, key)).fetchall()), key=lambda e: (e.created, e.attempt))


def queue_ready(conn: sqlite3.Connection, now: float) -> bool:
    """Is there a try to lease (queued, or leased with its lease run out)? Two index lookups, no lock."""
    return conn.execute("SELECT EXISTS (SELECT 1 FROM queue WHERE status = 'queued') OR EXISTS (SELECT 1 FROM queue "
                        "WHERE status = 'leased' AND lease_expires < ?)", (now,)).fetchone()[0] == 1
