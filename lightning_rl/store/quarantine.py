"""Records a store cannot write, told apart from a store that cannot be written, and described.

The writer (``writer.py``) asks :func:`is_record_error` whether a failed batch failed for a reason in
its own data. If so, it isolates the records that fail on their own; each is described here
(:func:`describe`: its rollout, why, and its original form as JSON text) and kept in the store's
quarantine (the ``quarantine`` table of a SQLite store), never retried, never spilled.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from typing import Any

import orjson

from ..boundaries import int64_problem, safe_text
from ..records import QuarantinedRecord, Reward, Rollout, SpanRow
from .rows import REWARD_COLUMNS, ROLLOUT_COLUMNS, SPAN_COLUMNS, spill_line

# Integer columns of each record, by name and position in its row.
_SPAN_INTS = {name: SPAN_COLUMNS.index(name) for name in ("seq", "start_ns", "end_ns", "prompt_base_seq", "prompt_shared",
                                                    "input_base_seq", "input_shared")}
_ROLLOUT_INTS = {name: ROLLOUT_COLUMNS.index(name) for name in ("attempt", "policy_version")}
_REWARD_INTS = {"llm_call_index": REWARD_COLUMNS.index("llm_call_index")}


def is_record_error(exc: BaseException) -> bool:
    """True when a write failed because of the records themselves (a value SQLite cannot bind, a
    constraint, a payload of the wrong shape); False when the database could not be written at all
    (locked, busy, full, read-only, an I/O error, a corrupt file): that is retried or spilled."""
    if isinstance(exc, (sqlite3.OperationalError, OSError, MemoryError)):
        return False
    if type(exc) is sqlite3.DatabaseError:  # "database disk image is malformed", "file is not a database"
        return False
    return True


def _int_problems(values: Any, columns: dict[str, int], what: str) -> str | None:
    if not isinstance(values, (list, tuple)):
        return None
    for name, i in columns.items():
        if i < len(values):
            problem = int64_problem(values[i], f"{what} {name}")
            if problem:
                return problem
    return None


def record_problem(kind: str, payload: Any) -> str | None:
    """The field of a writer item that no SQLite store can hold, named, or None if none is found."""
    if kind == "span" and isinstance(payload, SpanRow):
        for name in ("seq", "start_ns", "end_ns"):
            problem = int64_problem(getattr(payload, name), f"span {name}")
            if problem:
                return problem
        return None
    if kind in ("span_values", "span_packed"):
        return _int_problems(payload, _SPAN_INTS, "span")
    if kind == "rollout":
        values = [payload.attempt, payload.policy_version] if isinstance(payload, Rollout) else payload
        columns = {"attempt": 0, "policy_version": 1} if isinstance(payload, Rollout) else _ROLLOUT_INTS
        return _int_problems(values, columns, "rollout")
    if kind == "reward":
        if isinstance(payload, Reward):
            return int64_problem(payload.llm_call_index, "reward llm_call_index")
        return _int_problems(payload, _REWARD_INTS, "reward")
    if kind == "finish":
        return _int_problems(payload, {"policy_version": 4}, "finish")
    if kind == "expire" and isinstance(payload, (list, tuple)) and payload:
        return _int_problems(payload[0], _ROLLOUT_INTS, "rollout")
    return None


def rollout_of(kind: str, payload: Any) -> str | None:
    """The rollout a writer item belongs to, when it can be told."""
    try:
        if isinstance(payload, (SpanRow, Rollout, Reward)):
            found = payload.rollout_id
        elif kind == "expire":
            found = payload[0][0]
        else:
            found = payload[0]
    except (IndexError, KeyError, TypeError):
        return None
    return found if isinstance(found, str) else None


def describe(kind: str, payload: Any, exc: BaseException) -> tuple[str | None, str, str]:
    """``(rollout_id, reason, payload as text)`` of an item the writer could not write."""
    reason = record_problem(kind, payload) or f"{type(exc).__name__}: {exc}"
    try:
        text = spill_line(kind, payload).decode()
    except Exception:  # not even JSON can hold it (too deep, an integer beyond 64 bits): its description
        text = orjson.dumps({"kind": kind, "unencodable": safe_text(payload)}).decode()
    return rollout_of(kind, payload), f"{kind} could not be written: {reason}"[:2000], text


def insert_quarantine(conn: sqlite3.Connection, kind: str, rollout_id: Any, reason: str, text: str) -> bool:
    """A row of the SQLite ``quarantine`` table (in the caller's transaction); False if it was there already
    (a batch retried after a lock meets the same record again: it is kept once)."""
    rollout_id = rollout_id if isinstance(rollout_id, str) else None
    digest = hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()
    text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    cur = conn.execute("INSERT OR IGNORE INTO quarantine (time, kind, rollout_id, reason, payload, digest) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (time.time(), kind, rollout_id, reason, text, digest))
    return cur.rowcount > 0


def read_quarantine(conn: sqlite3.Connection, limit: int) -> list[QuarantinedRecord]:
    rows = conn.execute("SELECT quarantine_id, time, kind, rollout_id, reason, payload FROM quarantine "
                        "ORDER BY quarantine_id DESC LIMIT ?", (int(limit),)).fetchall()
    return [QuarantinedRecord(quarantine_id=q, time=t, kind=k, rollout_id=r, reason=why, payload=text)
            for q, t, k, r, why, text in rows]
