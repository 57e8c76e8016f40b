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
  the lease can heartbeat or complete (a late, expired runner's ``complete`` is refused). Given the try's
  ``rollout_id`` (the runner always sends it), only while the entry is still that try: an expired try
  re-leased to the same runner is a new try, and the old one's late ``complete`` is refused
  (``queue_results_refused_stale_try``) instead of ending the new one before it ran. A done entry
  keeps the runner that completed it, so that runner repeating the same outcome (a retry after a lost
  answer) is told yes again.
* ``cancel(queue_ids, reason=)`` ends tries that are queued or leased: they are ``cancelled``, never leased
  again (an expired lease does not bring one back), and the runner holding one is refused: its
  ``heartbeat`` and ``complete`` answer False (a refused result is counted,
  ``queue_results_refused_cancelled``). A leased try's rollout is marked as an expired one's is
  (``expire_rollout``): ``timed_out`` whatever its runner reports, before or after, with the reason as its
  error. Done tries are left as they are; a try cancelled before is answered again (a retried request).
* ``queries.wait_for_groups(store, group_ids)`` waits until every entry of those groups is done or cancelled.
* The cost of a lease does not grow with the work in flight: the expiry sweep reads only the leased
  entries whose lease ran out (``QueueView.expired``, an index on leased rows' expiry) and a retried
  request's entries are found by runner and key (``QueueView.held``), never by reading every leased row.
* Clocks: a lease's expiry is set and swept on one clock per store, never the leasing process's: the
  database's on PostgreSQL, the clock of the process that holds the store on SQLite and memory (the
  store server's, for runners that reach it over HTTP). A runner's clock may be off by hours.
* ``lease(..., wait=seconds)`` is a long poll: it answers as soon as a try can be leased, or empty after
  ``wait`` (:func:`lease_waiting`; a :class:`Bell` rung by enqueues in this process, or by the database).

A store that holds its queue itself (SQLite, memory) runs these rules inside one transaction of its
own (``txn(fn)``: ``fn(view)`` atomically): its ``enqueue``, ``lease``, ... are a line each over the
functions at the end of this module.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ..diagnostics import count
from ..errors import ConfigurationError
from ..records import Mode, QueueEntry, QueueStatus, Rollout, RolloutStatus
from .checks import check_cancel, check_overrides, check_task

T = TypeVar("T")
Txn = Callable[[Callable[["QueueView"], T]], T]


class QueueView(Protocol):
    """What a store gives the queue logic inside one atomic transaction."""

    def select(self, *, status: Sequence[QueueStatus], group_ids: Sequence[str] | None = None,
               queue_id: str | None = None, limit: int | None = None) -> list[QueueEntry]: ...

    def put(self, entries: Iterable[QueueEntry]) -> None: ...  # insert or replace

    def expired(self, now: float) -> list[QueueEntry]: ...  # leased entries whose lease ran out before now

    def held(self, runner: str, key: str) -> list[QueueEntry]: ...  # leased to runner by the request key


def new_group(task: Any, n: int, *, mode: str | Mode = Mode.TRAIN, max_tries: int = 3,
              group_id: str | None = None, overrides: dict[str, Any] | None = None) -> list[QueueEntry]:
    if n < 1:
        raise ConfigurationError(f"a task must be tried at least once, got n={n}")
    group_id = group_id or uuid.uuid4().hex
    return [QueueEntry(queue_id=uuid.uuid4().hex, group_id=group_id, task=task, attempt=i, mode=Mode(mode),
                       max_tries=max_tries, overrides=overrides) for i in range(n)]


def lease(view: QueueView, runner: str, lease_seconds: float, limit: int, now: float,
          expire_rollout: Callable[[QueueEntry, str], None], key: str | None = None) -> list[QueueEntry]:
    """The rules of a lease on one view (module doc); reads the expired and the asked-for entries only."""
    if key is not None:
        again = [e.model_copy(update={"lease_expires": now + lease_seconds}) for e in view.held(runner, key)]
        if again:  # this request was answered before and the answer lost: the same entries, no new try
            view.put(again)
            return again
    view.put([expire(entry, expire_rollout) for entry in view.expired(now)])
    out = [entry.model_copy(update={
        "status": QueueStatus.LEASED, "runner": runner, "lease_expires": now + lease_seconds,
        "tries": entry.tries + 1, "rollout_id": uuid.uuid4().hex, "lease_key": key,
    }) for entry in view.select(status=[QueueStatus.QUEUED], limit=limit)]
    view.put(out)
    return out


def expire(entry: QueueEntry, expire_rollout: Callable[[QueueEntry, str], None]) -> QueueEntry:
    """An entry whose lease ran out: its try's rollout is marked (``expire_rollout``) and it is queued again,
    or done ``timed_out`` after ``max_tries``."""
    if entry.rollout_id:
        expire_rollout(entry, f"lease of runner {entry.runner!r} expired")
    if entry.tries >= entry.max_tries:
        return entry.model_copy(update={"status": QueueStatus.DONE, "outcome": RolloutStatus.TIMED_OUT,
                                        "runner": None, "lease_expires": None})
    return entry.model_copy(update={"status": QueueStatus.QUEUED, "runner": None, "lease_expires": None,
                                    "lease_key": None})


def _held(view: QueueView, queue_id: str, runner: str, rollout_id: str | None = None) -> QueueEntry | None:
    """The entry ``runner`` holds now; with ``rollout_id``, only while it still holds that try (a retry of the
    same entry leased to the same runner is another try: the old one's late results never land on it)."""
    found = view.select(status=[QueueStatus.LEASED], queue_id=queue_id)
    if not found or found[0].runner != runner:
        return None
    if rollout_id is not None and found[0].rollout_id != rollout_id:
        return None
    return found[0]


def heartbeat(view: QueueView, queue_id: str, runner: str, lease_seconds: float, now: float,
              rollout_id: str | None = None) -> bool:
    entry = _held(view, queue_id, runner, rollout_id)
    if entry is None:
        return False
    view.put([entry.model_copy(update={"lease_expires": now + lease_seconds})])
    return True


def complete(view: QueueView, queue_id: str, runner: str, outcome: RolloutStatus | str,
             rollout_id: str | None = None) -> tuple[bool, QueueStatus | None]:
    """Whether the outcome is recorded (True also when this runner recorded it before: a retried request),
    and the status of the entry as found (None: none that ``runner`` held, or holds). With ``rollout_id``
    the outcome is that try's only: refused when the entry has moved on to another try."""
    outcome = RolloutStatus(outcome)
    entry = _held(view, queue_id, runner, rollout_id)
    if entry is None:  # already done by this runner with this outcome: a retried request, same answer
        found = view.select(status=[QueueStatus.DONE, QueueStatus.CANCELLED], queue_id=queue_id)
        if not found:  # unknown, another runner's lease, or another try
            return False, QueueStatus.LEASED if _held(view, queue_id, runner) else None
        ended = found[0]
        same_try = rollout_id is None or ended.rollout_id == rollout_id
        return (ended.status == QueueStatus.DONE and ended.runner == runner and ended.outcome == outcome
                and same_try), ended.status
    view.put([entry.model_copy(update={"status": QueueStatus.DONE, "outcome": outcome, "lease_expires": None})])
    return True, QueueStatus.LEASED


#: What ``cancel`` ends (a done try is left as it is; a cancelled one stays so).
CANCELLABLE = (QueueStatus.QUEUED, QueueStatus.LEASED)


def cancel(view: QueueView, queue_ids: Sequence[str]) -> list[QueueEntry]:
    """Cancel each named entry that is queued or leased (module doc). Returns the named entries that are
    cancelled now, in the order named, each as it was found: a leased one's try is to be marked
    (``expire_rollout``), one cancelled before is returned as it is (a retried request, same answer)."""
    out = []
    for queue_id in dict.fromkeys(queue_ids):
        found = view.select(status=[*CANCELLABLE, QueueStatus.CANCELLED], queue_id=queue_id)
        if not found:
            continue  # unknown, or done
        if found[0].status in CANCELLABLE:
            view.put([found[0].model_copy(update={"status": QueueStatus.CANCELLED, "lease_expires": None})])
        out.append(found[0])
    return out


def cancelled_try(entry: QueueEntry, reason: str) -> str:
    """The error text of a cancelled try's rollout."""
    return f"the queue cancelled this try of runner {entry.runner!r}" + (f": {reason}" if reason else "")


def wait_until(check: Callable[[], T], done: Callable[[T], bool], timeout: float | None, poll: float = 0.05) -> T:
    deadline = None if timeout is None else time.monotonic() + timeout
    value = check()
    while not done(value):
        if deadline is not None and time.monotonic() >= deadline:
            return value
        time.sleep(poll)
        value = check()
    return value


#: the longest one lease may wait (a store server caps a request's wait lower, under its clients' timeouts)
MAX_WAIT = 300.0
#: how often a waiting lease tries again although nothing rang: an expired lease, a missed signal
RECHECK = 1.0


def check_wait(wait: float) -> float:
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT:
        raise ConfigurationError(f"a lease waits 0 to {MAX_WAIT:.0f} seconds, got wait={wait!r}; "
                                 "give e.g. wait=5 (0: answer at once)")
    return float(wait)


class Bell:
    """Rung when the queue may have a try to lease (an enqueue, a re-queue); a waiting lease sleeps on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rings = 0

    def rings(self) -> int:
        return self._rings

    def ring(self) -> None:
        with self._cond:
            self._rings += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> bool:
        """True once rung after ``seen`` (:meth:`rings`), False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._rings != seen, max(timeout, 0.0))


def lease_waiting(lease_now: Callable[[], list[QueueEntry]], wait: float, bell: Bell,
                  probe: Callable[[], bool] | None = None) -> list[QueueEntry]:
    """``lease_now()`` until it leases something or ``wait`` seconds pass. Between tries it sleeps on
    ``bell`` (rung in this process), at most :data:`RECHECK` seconds; ``probe`` (a cheap read: is there
    anything to lease, from another process?) is asked with a back-off from 5 to 50 ms meanwhile."""
    deadline = time.monotonic() + check_wait(wait)
    step = 0.005
    while True:
        seen = bell.rings()
        got = lease_now()
        now = time.monotonic()
        if got or now >= deadline:
            return got
        until = min(deadline, now + RECHECK)
        while (left := until - time.monotonic()) > 0:
            if bell.wait(seen, min(step, left) if probe is not None else left):
                break
            if probe is not None and probe():
                break
            step = min(step * 2, 0.05)


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
    """:func:`lease` in one transaction, on this process's clock; the expired tries' rollouts are marked
    (``expire_rollout``) and flushed before the answer, so they read ``timed_out`` by the time their
    retries are handed out."""
    check_lease(lease_seconds, limit)
    expired: list[QueueEntry] = []

    def mark(entry: QueueEntry, reason: str) -> None:
        expire_rollout(entry, reason)
        expired.append(entry)

    leased = txn(lambda view: lease(view, runner, lease_seconds, limit, time.time(), mark, key))
    if expired:
        flush()
    return leased


def check_lease(lease_seconds: float, limit: int) -> None:
    if not isinstance(lease_seconds, (int, float)) or isinstance(lease_seconds, bool) or not lease_seconds > 0:
        raise ConfigurationError(f"a lease lasts more than 0 seconds, got lease_seconds={lease_seconds!r}; "
                                 "give e.g. lease_seconds=60")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ConfigurationError(f"a lease takes at least one try, got limit={limit!r}; give e.g. limit=1")


def heartbeat_in(txn: Txn, queue_id: str, runner: str, lease_seconds: float, rollout_id: str | None = None) -> bool:
    return txn(lambda view: heartbeat(view, queue_id, runner, lease_seconds, time.time(), rollout_id))


def complete_in(txn: Txn, queue_id: str, runner: str, outcome: RolloutStatus | str,
                rollout_id: str | None = None) -> bool:
    recorded, status = txn(lambda view: complete(view, queue_id, runner, outcome, rollout_id))
    if status == QueueStatus.CANCELLED:
        count("queue_results_refused_cancelled")  # its runner ran a try nobody waits for any more
    elif status == QueueStatus.LEASED and not recorded:
        count("queue_results_refused_stale_try")  # an expired try's result; the entry is its retry now
    return recorded


def cancel_in(txn: Txn, queue_ids: Sequence[str], reason: str,
              expire: Callable[[QueueView, QueueEntry, str], None]) -> list[str]:
    """:func:`cancel` in one transaction; ``expire(view, entry, why)`` marks a leased try's rollout (in that
    transaction, or queued to the store's writer). Returns the ids of the named tries that are cancelled."""
    ids = check_cancel(queue_ids, reason)

    def run(view: QueueView) -> list[QueueEntry]:
        found = cancel(view, ids)
        for entry in found:
            if entry.status == QueueStatus.LEASED and entry.rollout_id:
                expire(view, entry, cancelled_try(entry, reason))
        return found

    found = txn(run) if ids else []
    if newly := sum(e.status in CANCELLABLE for e in found):
        count("queue_tries_cancelled", newly)
    return [e.queue_id for e in found]


def entries_in(txn: Txn, group_ids: Sequence[str] | None) -> list[QueueEntry]:
    return txn(lambda view: view.select(status=list(QueueStatus), group_ids=group_ids))
