"""How a PostgreSQL store erases rollouts (``store/erasure.py`` says what goes; ``docs/retention.md``): DELETE,
then ``VACUUM`` of the tables (the space is reusable; PostgreSQL does not zero it, so the bytes stay in the
table files until new rows overwrite them); ``full=True`` runs ``VACUUM FULL`` (new table files, the old
ones removed) and a ``CHECKPOINT``. Copies in WAL segments (and in their archive, and in backups) stay
until those are recycled or expire: the database cannot reach them."""

from __future__ import annotations

from typing import Any

from ..erasure import ERASE_CHUNK, OWNED_TABLES

#: The tables VACUUM visits after an erasure.
ERASED_TABLES = (*OWNED_TABLES, "rollouts")


def delete_postgres(conn: Any, rollout_ids: list[str]) -> int:
    """Delete the rollouts' rows in the caller's transaction; returns the rollouts removed."""
    removed = 0
    with conn.cursor() as cur:
        for start in range(0, len(rollout_ids), ERASE_CHUNK):
            chunk = rollout_ids[start:start + ERASE_CHUNK]
            for table in OWNED_TABLES:
                cur.execute(f"DELETE FROM {table} WHERE rollout_id = ANY(%s)", (chunk,))
            cur.execute("DELETE FROM rollouts WHERE rollout_id = ANY(%s)", (chunk,))
            removed += cur.rowcount
    return removed


def vacuum_postgres(conn: Any, *, full: bool) -> None:
    """``VACUUM`` (or ``VACUUM FULL`` and a ``CHECKPOINT``) of the erased tables, on an autocommit connection."""
    with conn.cursor() as cur:
        cur.execute(f"VACUUM {'FULL ' if full else ''}{', '.join(ERASED_TABLES)}")
        if full:
            try:
                cur.execute("CHECKPOINT")  # the rewritten files reach the disk now, not at the next checkpoint
            except Exception:  # CHECKPOINT needs superuser or pg_checkpoint (PostgreSQL 15+): the next one comes anyway
                pass
