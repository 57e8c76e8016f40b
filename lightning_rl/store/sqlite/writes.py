"""The SQLite store's writes: a batch of ops in one transaction, the queue's view, a publish.

Each function runs on a connection its caller holds (the writer thread's, or the queue's under its
lock); the caller begins and commits the transaction.
"""

from __future__ import annotations

import functools
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
# Span rows go in one multi-row INSERT per batch (up to SPAN_ROWS_MOST rows a statement; past it, in chunks). Its
# size is rounded up to a multiple of 8 rows, the last row repeated to fill it: the copies are skipped by INSERT OR
# IGNORE (spans_rollout_seq), and there are at most 32 statement sizes, each prepared once by the connection's cache.
SPAN_ROWS_STEP = 8
SPAN_ROWS_MOST = 256


@functools.lru_cache(maxsize=None)
def _insert_spans_sql(rows: int) -> str:
    return _insert("spans", SPAN_COLUMNS, rows)


_TIMED_OUT = RolloutStatus.TIMED_OUT.value


def span_rows_most(conn: sqlite3.Connection) -> int:
    """Most span rows one INSERT may carry on ``conn``: ``SPAN_ROWS_MOST``, or fewer where the SQLite library
    binds fewer parameters a statement (999 before 3.32), a multiple of ``SPAN_ROWS_STEP``."""
    fit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(SPAN_COLUMNS)
    return max(1, min(SPAN_ROWS_MOST, fit - fit % SPAN_ROWS_STEP if fit >= SPAN_ROWS_STEP else fit))


def _insert_spans(conn: sqlite3.Connection, rows: list[tuple], most: int) -> None:
    """Insert span rows with one statement per ``most`` rows. Python's sqlite3 releases the GIL around every
    step and reset of a statement, and a writer thread that takes it back waits for the agent's thread to let
    it go (issue 57: each round trip costs both threads a wake-up on another core): so one statement per
    batch, not one per row (``executemany``) nor one per 16 rows."""
    for start in range(0, len(rows), most):
        chunk = rows[start:start + most]
        size = min(most, -(-len(chunk) // SPAN_ROWS_STEP) * SPAN_ROWS_STEP)
        params = [v for row in chunk for v in row]
        if size > len(chunk):  # the last row again, skipped by INSERT OR IGNORE: a statement size already prepared
            params.extend(chunk[-1] * (size - len(chunk)))
        conn.execute(_insert_spans_sql(size), params)


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
    most = span_rows_most(conn)
    if not (rollouts or rewards or finishes or expires or quarantined) and len(spans) <= most:
        if spans:  # a running rollout's spans, the usual batch: one statement, which is its own transaction
            _insert_spans(conn, spans, most)
        return []
    conn.execute("BEGIN IMMEDIATE")
    try:
        if rollouts:
            conn.executemany(INSERT_ROLLOUT, rollouts)
        if spans:
            _insert_spans(conn, spans, most)
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
