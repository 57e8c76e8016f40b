"""The ``PostgresStore``'s task queue (``PostgresQueue``, a base class of it, ``store.py``): the queue's
transactions on a view that locks as asked, an enqueue serialized by its group id, a lease in one statement on
the database's clock and a waiting lease woken by NOTIFY (the SQL and the listener: ``queue.py``), a cancel
that marks a leased try's rollout in its own transaction."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ...records import QueueEntry, RolloutStatus
from .. import checks, task_queue
from . import queue as pgq
from . import sql
from .schema import LOCK_GROUPS

T = TypeVar("T")


class PostgresQueue:
    """The ``TaskQueue`` of ``PostgresStore`` (``store.py``), over its pool (``_with``, ``_txn``)."""

    schema: str
    shown: str
    _durable: Any
    _listener: pgq.Listener | None
    _listen_lock: threading.Lock
    _bell: task_queue.Bell
    _closed: bool

    # -- TaskQueue (atomic in the database, across every process that opens it) -----------------------
    def _queue(self, lock: str | None = None, group: str | None = None, notify: bool = False) -> task_queue.Txn:
        """The queue's transactions, each on a view that locks as ``lock`` says (``sql.QueueView``);
        ``group``: serialize with any other transaction queuing that group id; ``notify``: wake every
        process's waiting leases at commit (``postgres/queue.py``)."""

        def txn(fn: Callable[[Any], T]) -> T:
            def run(conn: Any) -> T:
                if group is not None:
                    with conn.cursor() as cur:
                        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_GROUPS, group))
                result = fn(sql.QueueView(conn, lock))
                if notify:
                    pgq.notify(conn, self.schema)
                return result

            return self._txn(run, what="the task queue")

        return txn

    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False,
                overrides: Mapping[str, Any] | None = None) -> list[QueueEntry]:
        """As every store's. Without a ``group_id`` one is made and the call is ``once``: a retry after a lost
        answer does not queue the task twice."""
        if self._durable is None:
            raise checks.read_only("enqueue", self.shown)
        if group_id is None:
            group_id, once = uuid.uuid4().hex, True
        return task_queue.enqueue_in(self._queue(group=group_id if once else None, notify=True), task, n=n, mode=mode,
                                     max_tries=max_tries, group_id=group_id, once=once, overrides=overrides)

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None, wait: float = 0.0) -> list[QueueEntry]:
        """As every store's, in one statement on the database's clock (``postgres/queue.py``); an expired try's
        rollout is marked ``timed_out`` in the lease's own transaction (atomic with its retry: no process that
        dies in between can leave it running). ``wait``: woken by the database's NOTIFY of an enqueue."""
        task_queue.check_lease(lease_seconds, limit)
        key = key or uuid.uuid4().hex

        def lease_now() -> list[QueueEntry]:
            return self._txn(lambda conn: pgq.lease(conn, self.schema, runner, lease_seconds, limit, key),
                             what="the task queue")

        if not wait:
            return lease_now()
        task_queue.check_wait(wait)
        with self._listen_lock:
            if self._listener is None and not self._closed:
                self._listener = pgq.Listener(self._connect, self.schema, self._bell, self.shown)
        return task_queue.lease_waiting(lease_now, wait, self._bell)

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0,
                  rollout_id: str | None = None) -> bool:
        """Extends the lease from the database's clock, not this process's."""
        task_queue.check_lease(lease_seconds, 1)

        def beat(conn: Any) -> bool:
            with conn.cursor() as cur:
                cur.execute(pgq.HEARTBEAT, (float(lease_seconds), queue_id, runner, rollout_id, rollout_id))
                return cur.rowcount > 0

        return self._with(beat, what="the task queue")

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str, *,
                 rollout_id: str | None = None) -> bool:
        self.flush()  # the records written so far go first
        return task_queue.complete_in(self._queue("wait"), queue_id, runner, outcome, rollout_id)

    def cancel(self, queue_ids: Sequence[str], *, reason: str = "") -> list[str]:
        """As every store's; a leased try's rollout is marked ``timed_out`` in the cancel's own transaction (no
        process that dies in between can leave it to end as a success)."""
        if self._durable is None:
            raise checks.read_only("cancel", self.shown)

        def expire(view: sql.QueueView, entry: QueueEntry, why: str) -> None:
            with view.conn.cursor() as cur:
                sql.expire_try(cur, task_queue.tombstone(entry, why))

        return task_queue.cancel_in(self._queue("wait"), queue_ids, reason, expire)

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        return task_queue.entries_in(self._queue(), group_ids)
