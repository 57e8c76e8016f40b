"""Records a store cannot write, told apart from a store that cannot be written, and described.

The writer (``writer.py``) asks :func:`is_record_error` whether a failed batch failed for a reason in
its own data. If so, it isolates the ops that fail on their own; each is described here
(:func:`describe`: a ``Quarantine`` op with its rollout, why, and its original form as JSON text) and
kept in the store's quarantine (the ``quarantine`` table of a SQLite store), never retried, never spilled.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from typing import Any

import orjson

from ..boundaries import int64_problem, safe_text
from ..records import QuarantinedRecord
from . import wire
from .ops import (
    EncodedSpan,
    ExpireTry,
    FinishRollout,
    Op,
    Quarantine,
    StartRollout,
    TracedSpan,
    WriteReward,
    rollout_of,
)
from .rows import SPAN_COLUMNS

# Integer columns of a span row, by name and position.
_SPAN_INTS = {name: SPAN_COLUMNS.index(name) for name in ("seq", "start_ns", "end_ns", "prompt_base_seq", "prompt_shared",
                                                    "input_base_seq", "input_shared")}


def is_record_error(exc: BaseException) -> bool:
    """True when a write failed because of the records themselves (a value SQLite cannot bind, a
    constraint, a payload of the wrong shape); False when the database could not be written at all
    (locked, busy, full, read-only, an I/O error, a corrupt file): that is retried or spilled."""
    if isinstance(exc, (sqlite3.OperationalError, OSError, MemoryError)):
        return False
    if type(exc) is sqlite3.DatabaseError:  # "database disk image is malformed", "file is not a database"
        return False
    return True


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


def record_problem(op: Op) -> str | None:
    """The field of an op that no SQLite store can hold, named, or None if none is found."""
    kind = type(op)
    if kind is TracedSpan:
        return _first(*(int64_problem(getattr(op.row, name), f"span {name}") for name in ("seq", "start_ns", "end_ns")))
    if kind is EncodedSpan:
        return _first(*(int64_problem(op.values[i], f"span {name}") for name, i in _SPAN_INTS.items()
                        if i < len(op.values)))
    if kind is StartRollout or kind is ExpireTry:
        rollout = op.rollout if kind is StartRollout else op.tombstone
        return _first(int64_problem(rollout.attempt, "rollout attempt"),
                      int64_problem(rollout.policy_version, "rollout policy_version"))
    if kind is WriteReward:
        return int64_problem(op.reward.llm_call_index, "reward llm_call_index")
    if kind is FinishRollout:
        return int64_problem(op.policy_version, "finish policy_version")
    return None


def describe(op: Op, exc: BaseException) -> Quarantine:
    """An op the writer could not write, as its description: its rollout, why, and its original form
    (its wire JSON) or, when not even JSON can hold it, a bounded text of it."""
    reason = record_problem(op) or f"{type(exc).__name__}: {exc}"
    try:
        text = wire.encode(op).decode()
    except Exception:  # not even JSON can hold it (too deep, an integer beyond 64 bits): its description
        text = orjson.dumps({"kind": op.kind, "unencodable": safe_text(op)}).decode()
    return Quarantine(op.kind, rollout_of(op), f"{op.kind} could not be written: {reason}"[:2000], text)


def digest_of(kind: str, text: str) -> str:
    """What keeps a quarantined record once however often its batch is retried: its kind and form, hashed."""
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


def insert_quarantine(conn: sqlite3.Connection, kind: str, rollout_id: Any, reason: str, text: str) -> bool:
    """A row of the SQLite ``quarantine`` table (in the caller's transaction); False if it was there already
    (a batch retried after a lock meets the same record again: it is kept once)."""
    rollout_id = rollout_id if isinstance(rollout_id, str) else None
    digest = digest_of(kind, text)
    text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    cur = conn.execute("INSERT OR IGNORE INTO quarantine (time, kind, rollout_id, reason, payload, digest) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (time.time(), kind, rollout_id, reason, text, digest))
    return cur.rowcount > 0


def read_quarantine(conn: sqlite3.Connection, limit: int) -> list[QuarantinedRecord]:
    rows = conn.execute("SELECT quarantine_id, time, kind, rollout_id, reason, payload FROM quarantine "
                        "ORDER BY quarantine_id DESC LIMIT ?", (int(limit),)).fetchall()
    return [QuarantinedRecord(quarantine_id=q, time=t, kind=k, rollout_id=r, reason=why, payload=text)
            for q, t, k, r, why, text in rows]
