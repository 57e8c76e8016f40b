"""How a SQLite store erases rollouts (``store/erasure.py`` says what goes; ``docs/retention.md``): the DELETE
runs with ``PRAGMA secure_delete = ON`` (SQLite zeroes the freed cells and pages), then
``PRAGMA wal_checkpoint(TRUNCATE)`` copies the pages back and truncates the WAL, so no older copy stays
there. ``full=True`` then runs ``VACUUM`` (the file shrinks to what it holds)."""

from __future__ import annotations

import sqlite3
import time

from ...errors import StoreError
from ..erasure import ERASE_CHUNK, OWNED_TABLES


def _marks(n: int, mark: str = "?") -> str:
    return ", ".join([mark] * n)


def erase_sqlite(conn: sqlite3.Connection, rollout_ids: list[str], *, full: bool, busy_timeout: float,
                 where: str) -> int:
    """Delete the rollouts' rows on ``conn`` (its caller holds it) with freed bytes zeroed, then empty
    the WAL (and ``VACUUM`` with ``full``). Returns the rollouts removed."""
    conn.execute("PRAGMA secure_delete = ON")
    removed = 0
    conn.execute("BEGIN IMMEDIATE")
    try:
        for start in range(0, len(rollout_ids), ERASE_CHUNK):
            chunk = rollout_ids[start:start + ERASE_CHUNK]
            marks = _marks(len(chunk))
            for table in OWNED_TABLES:
                conn.execute(f"DELETE FROM {table} WHERE rollout_id IN ({marks})", chunk)
            removed += conn.execute(f"DELETE FROM rollouts WHERE rollout_id IN ({marks})", chunk).rowcount
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    if full:
        conn.execute("VACUUM")
    checkpoint_sqlite(conn, busy_timeout, where)
    return removed


def checkpoint_sqlite(conn: sqlite3.Connection, busy_timeout: float, where: str) -> None:
    """Copy the WAL into the database file and truncate it to nothing; retried while readers hold it."""
    deadline = time.monotonic() + busy_timeout
    while True:
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if not busy:
            return
        if time.monotonic() >= deadline:
            raise StoreError(
                f"the rollouts were deleted from {where}, but its WAL file could not be emptied in {busy_timeout:g} s "
                "(another process holds a read open): an older copy of their text may stay in it until it is. Run "
                "the erasure again (or `lightning-rl store prune`) when the other processes are idle")
        time.sleep(0.05)
