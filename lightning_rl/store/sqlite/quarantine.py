"""A SQLite store's quarantine (``store/quarantine.py`` says what goes there): which failed writes are the
records' own fault (``is_record_error``), and the rows of its ``quarantine`` table (``insert_quarantine``,
``read_quarantine``)."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from ...records import QuarantinedRecord
from ..quarantine import digest_of


def is_record_error(exc: BaseException) -> bool:
    """True when a write failed because of the records themselves (a value SQLite cannot bind, a
    constraint, a payload of the wrong shape); False when the database could not be written at all
    (locked, busy, full, read-only, an I/O error, a corrupt file): that is retried or spilled."""
    if isinstance(exc, (sqlite3.OperationalError, OSError, MemoryError)):
        return False
    if type(exc) is sqlite3.DatabaseError:  # "database disk image is malformed", "file is not a database"
        return False
    return True


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
