"""The task queue: tasks tried n times (one GRPO group), leased to runners, retried when a runner dies.

Rules:

* ``enqueue(task, n=4)`` makes n entries that share a ``group_id``.
* ``lease(runner, lease_seconds)`` hands out queued entries, and entries whose lease expired (their
  runner died or hung). An expired try's rollout is marked ``timed_out`` ("lease expired") whatever it
  reports, before or after (``Store.expire_rollout``), is kept, and is never mixed into the retry, which
  gets a fresh rollout id. An entry leased ``max_tries`` times whose lease expires again is done with
  outcome ``timed_out``.
* A lease request may carry a ``key`` (``HttpStore`` sends a fresh one per call): asking again with
  the same runner and key returns the entries that request leased, so a retry after a lost answer
  (a server killed between its commit and its reply) gets them instead of stranding them until they
  expire.
* ``heartbeat`` extends a lease; ``complete`` records the rollout's outcome. Only the runner holding
  the lease can heartbeat or complete (a late, expired runner's ``complete`` is refused). A done entry
  keeps the runner that completed it, so that runner repeating the same outcome (a retry after a lost
  answer) is told yes again.
* ``queries.wait_for_groups(store, group_ids)`` waits until every entry of those groups is done.

A store that holds its queue itself (SQLite, memory) runs these rules inside one transaction of its
own (``txn(fn)``: ``fn(view)`` atomically): its ``enqueue``, ``lease``, ... are a line each over the
functions at the end of this module.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ..errors import ConfigurationError
from ..records import Mode, QueueEntry, QueueStatus, Rollout, RolloutStatus
from .checks import check_overrides, check_task

T = TypeVar("T")
Txn = Callable[[Callable[["QueueView"], T]], T]


class QueueView(Protocol):
    """What a store gives the queue logic inside one atomic transaction."""

    def select(self, *, status: Sequence[QueueStatus], group_ids: Sequence[str] | None = None,
               queue_id: str | None = None, limit: int | None = None) -> list[QueueEntry]: ...

    def put(self, entries: Iterable[QueueEntry]) -> None: ...  # insert or replace


def new_group(task: Any, n: int, *, mode: str | Mode = Mode.TRAIN, max_tries: int = 3,
              group_id: str | None = None, overrides: dict[str, Any] | None = None) -> list[QueueEntry]:
    if n < 1:
        raise ConfigurationError(f"a task must be tried at least once, got n={n}")
    group_id = group_id or uuid.uuid4().hex
    return [QueueEntry(queue_id=uuid.uuid4().hex, group_id=group_id, task=task, attempt=i, mode=Mode(mode),
                       max_tries=max_tries, overrides=overrides) for i in range(n)]


def lease(view: QueueView, runner: str, lease_seconds: float, limit: int, now: float,
          expire_rollout: Callable[[QueueEntry, str], None], key: str | None = None) -> list[QueueEntry]:
    out: list[QueueEntry] = []
    changed: list[QueueEntry] = []
    held = view.select(status=[QueueStatus.LEASED])
    if key is not None:
        again = [e.model_copy(update={"lease_expires": now + lease_seconds})
                 for e in held if e.runner == runner and e.lease_key == key]
        if again:  # this request was answered before and the answer lost: the same entries, no new try
            view.put(again)
            return again
    for entry in held:
        if entry.lease_expires is not None and entry.lease_expires < now:
            if entry.rollout_id:
                expire_rollout(entry, f"lease of runner {entry.runner!r} expired")
            if entry.tries >= entry.max_tries:
                entry = entry.model_copy(update={"status": QueueStatus.DONE, "outcome": RolloutStatus.TIMED_OUT,
                                                 "runner": None, "lease_expires": None})
            else:
                entry = entry.model_copy(update={"status": QueueStatus.QUEUED, "runner": None, "lease_expires": None,
                                                 "lease_key": None})
            changed.append(entry)
    view.put(changed)
    for entry in view.select(status=[QueueStatus.QUEUED], limit=limit):
        leased = entry.model_copy(update={
            "status": QueueStatus.LEASED, "runner": runner, "lease_expires": now + lease_seconds,
            "tries": entry.tries + 1, "rollout_id": uuid.uuid4().hex, "lease_key": key,
        })
        out.append(leased)
    view.put(out)
    return out


def _held(view: QueueView, queue_id: str, runner: str) -> QueueEntry | None:
    found = view.select(status=[QueueStatus.LEASED], queue_id=queue_id)
    return found[0] if found and found[0].runner == runner else None


def heartbeat(view: QueueView, queue_id: str, runner: str, lease_seconds: float, now: float) -> bool:
    entry = _held(view, queue_id, runner)
    if entry is None:
        return False
    view.put([entry.model_copy(update={"lease_expires": now + lease_seconds})])
    return True


def complete(view: QueueView, queue_id: str, runner: str, outcome: RolloutStatus | str) -> bool:
    outcome = RolloutStatus(outcome)
    entry = _held(view, queue_id, runner)
    if entry is None:  # already done by this runner with this outcome: a retried request, same answer
        done = view.select(status=[QueueStatus.DONE], queue_id=queue_id)
        return bool(done) and done[0].runner == runner and done[0].outcome == outcome
    view.put([entry.model_copy(update={"status": QueueStatus.DONE, "outcome": outcome, "lease_expires": None})])
    return True


def wait_until(check: Callable[[], T], done: Callable[[T], bool], timeout: float | None, poll: float = 0.05) -> T:
    deadline = None if timeout is None else time.monotonic() + timeout
    value = check()
    while not done(value):
        if deadline is not None and time.monotonic() >= deadline:
            return value
        time.sleep(poll)
        value = check()
    return value


def tombstone(entry: QueueEntry, reason: str) -> Rollout:
    """The rollout row of an expired try that never started: ``timed_out`` at once, so a late start
    cannot bring it back as a success outside the queue."""
    now = time.time()
    return Rollout(rollout_id=entry.rollout_id, task=entry.task, group_id=entry.group_id, attempt=entry.attempt,
                   mode=entry.mode, status=RolloutStatus.TIMED_OUT, start_time=now, end_time=now, error=reason)


# -- a store's TaskQueue methods, over its transactions ------------------------------------------------
def enqueue_in(txn: Txn, task: Any, *, n: int, mode: str, max_tries: int, group_id: str | None,
               once: bool, overrides: Any = None) -> list[QueueEntry]:
    check_task(task, mode=mode, max_tries=max_tries)
    entries = new_group(task, n, mode=mode, max_tries=max_tries, group_id=group_id,
                        overrides=check_overrides(overrides))

    def put(view: QueueView) -> list[QueueEntry]:
        if once and group_id is not None:
            existing = view.select(status=list(QueueStatus), group_ids=[group_id])
            if existing:
                return existing
        view.put(entries)
        return entries

    return txn(put)


def lease_in(txn: Txn, runner: str, *, lease_seconds: float, limit: int, key: str | None,
             expire_rollout: Callable[[QueueEntry, str], None], flush: Callable[[], object]) -> list[QueueEntry]:
    """:func:`lease` in one transaction; the expired tries' rollouts are marked (``expire_rollout``) and
    flushed before the answer, so they read ``timed_out`` by the time their retries are handed out."""
    expired: list[QueueEntry] = []

    def expire(entry: QueueEntry, reason: str) -> None:
        expire_rollout(entry, reason)
        expired.append(entry)

    leased = txn(lambda view: lease(view, runner, lease_seconds, limit, time.time(), expire, key))
    if expired:
        flush()
    return leased


def heartbeat_in(txn: Txn, queue_id: str, runner: str, lease_seconds: float) -> bool:
    return txn(lambda view: heartbeat(view, queue_id, runner, lease_seconds, time.time()))


def complete_in(txn: Txn, queue_id: str, runner: str, outcome: RolloutStatus | str) -> bool:
    return txn(lambda view: complete(view, queue_id, runner, outcome))


def entries_in(txn: Txn, group_ids: Sequence[str] | None) -> list[QueueEntry]:
    return txn(lambda view: view.select(status=list(QueueStatus), group_ids=group_ids))
