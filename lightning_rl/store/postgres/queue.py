"""The PostgreSQL store's task queue at fleet size: a lease is one statement, on the database's clock.

Rules (``task_queue.py`` states the queue's; these are how PostgreSQL keeps them):

* One statement per lease (:data:`LEASE`): it sweeps the leased rows whose lease ran out (the partial
  index ``queue_leased_expiry``: only those rows are read or written), finds a retried request's rows by
  runner and key (``queue_leased_key``), and takes up to ``limit`` queued rows with ``FOR UPDATE SKIP
  LOCKED`` (two runners, on two servers or connected directly, never get the same try). The swept tries'
  rollouts are marked ``timed_out`` in the same transaction (``sql.expire_try``).
* Expiry is on the database's clock (``clock_timestamp()``): a lease's end is set by a lease or a
  heartbeat and compared by a sweep on that one clock, so a runner's own clock may be off by hours.
* A waiting lease (``wait=``) sleeps until an enqueue or a re-queue NOTIFYs the store's channel
  (:func:`channel`; sent at commit), heard by one LISTEN connection per store process
  (:class:`Listener`), which rings the store's ``task_queue.Bell``.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from ...diagnostics import count, report_failure
from ...records import QueueEntry
from .. import task_queue
from .sql import expire_try
from ..rows import QUEUE_COLUMNS, queue_from_values

_COLS = ", ".join(f"q.{c}" for c in QUEUE_COLUMNS)
_NOW = "extract(epoch FROM clock_timestamp())::float8"

#: One lease: sweep, retry by key, take fresh rows. Each row comes back with what happened to it
#: (``expired``, ``again``, ``leased``) and, for an expired one, the runner whose lease ran out.
LEASE = f"""
WITH clock AS (SELECT {_NOW} AS now),
gone AS (
    SELECT queue.queue_id, queue.runner AS old_runner FROM queue, clock
    WHERE queue.status = 'leased' AND queue.lease_expires < clock.now
    ORDER BY queue.lease_expires FOR UPDATE OF queue SKIP LOCKED),
swept AS (
    UPDATE queue q SET
        status = CASE WHEN q.tries >= q.max_tries THEN 'done' ELSE 'queued' END,
        outcome = CASE WHEN q.tries >= q.max_tries THEN 'timed_out' ELSE q.outcome END,
        lease_key = CASE WHEN q.tries >= q.max_tries THEN q.lease_key END,
        runner = NULL, lease_expires = NULL
    FROM gone WHERE q.queue_id = gone.queue_id
    RETURNING 'expired'::text AS what, gone.old_runner, {_COLS}),
again AS (
    UPDATE queue q SET lease_expires = clock.now + %(seconds)s FROM clock
    WHERE q.status = 'leased' AND q.runner = %(runner)s AND q.lease_key = %(key)s AND q.lease_expires >= clock.now
    RETURNING 'again'::text AS what, NULL::text AS old_runner, {_COLS}),
fresh AS (
    UPDATE queue q SET status = 'leased', runner = %(runner)s, lease_expires = clock.now + %(seconds)s,
        tries = q.tries + 1, rollout_id = replace(gen_random_uuid()::text, '-', ''), lease_key = %(key)s
    FROM clock
    WHERE q.queue_id IN (
        SELECT queue_id FROM queue WHERE status = 'queued' AND NOT EXISTS (SELECT 1 FROM again)
        ORDER BY created, attempt LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
    RETURNING 'leased'::text AS what, NULL::text AS old_runner, {_COLS})
SELECT * FROM swept UNION ALL SELECT * FROM again UNION ALL SELECT * FROM fresh
"""

HEARTBEAT = (f"UPDATE queue SET lease_expires = {_NOW} + %s "
             "WHERE queue_id = %s AND status = 'leased' AND runner = %s "
             "AND (%s::text IS NULL OR rollout_id = %s)")

#: Is there anything to lease now (queued, or leased with its lease run out)?
READY = (f"SELECT EXISTS (SELECT 1 FROM queue WHERE status = 'queued') OR EXISTS (SELECT 1 FROM queue "
         f"WHERE status = 'leased' AND lease_expires < {_NOW})")


def channel(schema: str) -> str:
    """The NOTIFY channel of the store in ``schema`` (a name under PostgreSQL's 63 bytes whatever the schema's)."""
    return "lightning_rl_queue_" + hashlib.sha1(schema.encode()).hexdigest()[:16]


def notify(conn: Any, schema: str) -> None:
    """Wake the waiting leases of every process on this store, when the caller's transaction commits."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_notify(%s, '')", (channel(schema),))


def lease(conn: Any, schema: str, runner: str, lease_seconds: float, limit: int, key: str) -> list[QueueEntry]:
    """:data:`LEASE` in the caller's transaction; the swept tries' rollouts are marked ``timed_out`` in it. The
    statement's own sweep re-queues rows its snapshot cannot lease: when it swept some and leased fewer than
    ``limit``, it runs once more (only then), so a lease takes an expired try at once, as every store's does."""
    found: dict[str, list[QueueEntry]] = {"again": [], "leased": []}
    requeued = 0
    for _ in range(2):
        swept = 0
        with conn.cursor() as cur:
            cur.execute(LEASE, {"runner": runner, "seconds": float(lease_seconds),
                                "limit": int(limit) - len(found["leased"]), "key": key})
            for what, old_runner, *values in cur.fetchall():
                entry = queue_from_values(values)
                if what == "expired":
                    count("queue_leases_expired")
                    swept += entry.status.value == "queued"
                    if entry.rollout_id:
                        expire_try(cur, task_queue.tombstone(entry, f"lease of runner {old_runner!r} expired"))
                else:  # "again" (a retried request: what it leased before, nothing more) or "leased"
                    found[what].append(entry)
        requeued += swept
        if not swept or found["again"] or len(found["leased"]) >= limit:
            break
    if requeued:  # other waiting runners may take what this lease did not
        notify(conn, schema)
    return sorted(found["again"] or found["leased"], key=lambda e: (e.created, e.attempt))


class Listener:
    """One LISTEN connection of a store process: every NOTIFY on the store's channel rings ``bell``. Started
    by the first waiting lease; made again (and the bell rung, so waiters look) when the connection breaks."""

    def __init__(self, connect: Any, schema: str, bell: task_queue.Bell, where: str) -> None:
        self._connect = connect
        self._channel = channel(schema)
        self._bell = bell
        self._where = where
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lightning-rl-listen:{where}", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)  # listening before the first wait begins, so no NOTIFY after it is missed

    def _run(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            conn = None
            try:
                conn = self._connect()
                conn.execute(f'LISTEN "{self._channel}"')
                self._ready.set()
                self._bell.ring()  # anything sent while we were not listening: the waiters look once
                delay = 0.1
                while not self._stop.is_set():
                    for _ in conn.notifies(timeout=1.0):
                        self._bell.ring()
            except Exception as exc:  # the database went away: listen again when it is back
                if self._stop.is_set():
                    return
                count("queue_listen_reconnects")
                report_failure(f"queue LISTEN on {self._where}", exc)
                self._ready.set()  # waiters fall back to their 1 s rechecks meanwhile
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if conn is not None:
                    conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3.0)
