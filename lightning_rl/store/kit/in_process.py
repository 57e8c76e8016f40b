"""For a store that keeps everything in this process (the in-memory one, a toy backend): ``ImmediateWriter``
applies each op as it comes, ``DictQueueView`` is the task queue over a dict. ``kit/base.py`` re-exports both."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ...records import QueueEntry, QueueStatus
from ..ops import Op
from ..quarantine import describe, record_problem
from .batch import Batch, sort_ops


class ImmediateWriter:
    """The writer of a store that writes at once (in memory): each op applied as it comes, what no SQLite
    store could hold set aside in the quarantine instead (one contract for every store)."""

    pending = 0

    def __init__(self, apply: Callable[[Batch], None]) -> None:
        self._apply = apply

    def put(self, op: Op) -> None:
        self.put_many([op])

    def put_many(self, ops: list[Op]) -> None:
        self._apply(sort_ops(op if (problem := record_problem(op)) is None else describe(op, ValueError(problem))
                             for op in ops))

    def flush(self, timeout: float | None = None) -> bool:
        return True

    flush_applied = flush


class DictQueueView:
    """``task_queue.QueueView`` over a dict of entries by ``queue_id``, for stores that keep the queue in this
    process (the caller's ``_queue_txn`` holds its lock). A scan: such a store serves one process, not a fleet
    (SQLite and PostgreSQL read an index)."""

    def __init__(self, entries: dict[str, QueueEntry]) -> None:
        self._entries = entries

    def select(self, *, status: Sequence[Any], group_ids: Sequence[str] | None = None,
               queue_id: str | None = None, limit: int | None = None) -> list[QueueEntry]:
        out = [e for e in self._entries.values()
               if e.status in status and (group_ids is None or e.group_id in group_ids)
               and (queue_id is None or e.queue_id == queue_id)]
        out.sort(key=lambda e: (e.created, e.attempt))
        return out[:limit] if limit is not None else out

    def put(self, entries: Iterable[QueueEntry]) -> None:
        for e in entries:
            self._entries[e.queue_id] = e

    def expired(self, now: float) -> list[QueueEntry]:
        return [e for e in self._entries.values() if e.status == QueueStatus.LEASED
                and e.lease_expires is not None and e.lease_expires < now]

    def held(self, runner: str, key: str) -> list[QueueEntry]:
        return sorted((e for e in self._entries.values() if e.status == QueueStatus.LEASED and e.runner == runner
                       and e.lease_key == key), key=lambda e: (e.created, e.attempt))
