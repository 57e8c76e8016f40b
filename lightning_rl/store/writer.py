"""A background writer with a bounded queue: batches ops, applies back-pressure, never drops.

Producers call ``put`` with an op (``store/ops.py``); when the queue holds ``maxsize`` ops they wait
(back-pressure) instead of dropping anything. The writer thread takes everything queued as one batch
and hands it to ``apply``. A batch that keeps failing is retried with backoff for ``give_up_after`` seconds and then
handed to ``spill`` (a file next to the store) so that it is kept, never silently lost.

Order is kept: once a batch is spilled, every later batch is spilled behind it until ``replay``
(tried every ``replay_every`` seconds, also while nothing new arrives) has written the backlog
back. ``flush`` returns once everything put before it has been applied or spilled; ``flush_applied``
says whether it was applied.

The commit window (``window`` > 0, ``may_wait``): an op that ``may_wait`` accepts (a span of a rollout
that is still running) waits up to ``window`` seconds for others to share its transaction; anything else
(a rollout's start or finish, a reward, a flush marker, an ingest's batch) is written at once, with
everything queued before it, and so is a batch of ``maxsize // 4`` ops. So a finished rollout is
committed as soon as without a window, and a process killed outright loses at most the spans its running
rollouts ended in the last ``window`` seconds (and the transaction in progress). ``window=0`` (the
default): every batch is written as it comes.

Waking (issue 57). Every time this thread wakes it needs the GIL back, and while the agent's thread runs
Python it rarely gets it: an agent that lets the GIL go only for a moment (the openai client's ``uuid4()``,
an ``os.urandom``, per request) wakes it each time, and it loses the race each time, for many calls in a
row: a futex round trip on two cores for both threads, per call. So it wakes as seldom as the window
allows. With the window, after a batch the window closed on it waits one window for the next ops instead
of sleeping until a first op wakes it (a steady stream: one wake a window, and a put notifies only a
sleeping writer), and it does not linger after a batch; after a flush, a finish or a wait that found
nothing it sleeps until told. Its SQLite store writes a running rollout's spans in one statement a batch
(``sqlite/writes.py``): Python's sqlite3 lets the GIL go around every step of a statement. And a put that finds
its buffer's window closed more than ``HAND_OVER_AFTER`` ago with the batch not taken (the writer is waiting for
the GIL) waits for the writer to write it, letting the GIL go: one window at most, and not again until the
writer has written (a store that cannot be written is not waited on); counted as ``writer_hand_overs``. So a
running rollout's spans reach the store within about a window even from an agent that never waits.

Writing here (issue 57, ``write_here``: the SQLite store). Even one wake a window costs: the writer runs its
Python on the other core, so the interpreter's shared state (reference counts of common objects, the
allocator's pools) moves between the cores' caches, and the agent's thread pays for it too. Measured in one
process at 40+4 (the same calls with the store and with a sink that drops every span, paired, three runs
each, 2026-11-29): with letting in (below) and every batch written by the writer, the durable row cost 63-88
us a call; written on the agent's thread, 45-62. So a put that finds its buffer's window about to close
(``HAND_OVER_AFTER`` before it; spans only: no flush, no finish, no ingest waiting) while the writer is not
writing takes the batch and writes it itself, on its own thread, with ``write_here``: a write that never
waits (its store refuses it at once where the database is locked). If that raises, the batch goes back to
the front of the queue for the writer, which writes it as any other (retries, spill, quarantine), and no
put writes here again until the writer has written a batch. The writer does not take a batch while one is
written here, and takes a window's batch itself when the window closes, as before: so spans reach the store
within a window when the puts stop, and in a stream a putting thread, which comes by more often than that,
takes it first.

Letting in (issue 57). The writer still comes out of its waits on its timer (a window after the first op,
the backstop for an agent that stops putting), and then it needs the GIL: while the agent's thread runs
Python and lets it go only for a moment, the waiting thread is woken at each such moment and loses the race
each time (CPython asks the holder to drop it only after a whole switch interval with no switch at all), one
futex round trip on both threads per put: 978 voluntary switches of the writer for 1,000 calls at 40+4,
16 us a call. A put that finds the writer ``HAND_OVER_AFTER`` past when it was due out of its wait and not
out yet waits until it is (letting the GIL go): 139 switches, 6 us. That is the normal path, not counted;
a writer not out within one window is (``writer_let_ins_timed_out``), and is not waited on again until it
comes out.

Two failures, two paths. The spill is for a store that cannot be written at all (locked, full,
away). A batch that fails for a reason in its own data (``is_record_error``: a value the database
cannot bind) is not retried: it is split in halves, down to the ops that fail on their own, which go
to ``quarantine`` with the error; the rest is written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..diagnostics import count, report_failure
from ..errors import StoreClosedError

#: Seconds past its window after which a due batch the writer has not taken is handed over (module doc, "Waking").
HAND_OVER_AFTER = 0.005


class _Marker:
    """A flush marker: set once everything queued before it is applied (or spilled)."""

    __slots__ = ("event", "spilled")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.spilled = False


class BackgroundWriter:
    def __init__(
        self,
        apply: Callable[[list[Any]], None],
        *,
        maxsize: int = 8192,
        name: str = "lightning-rl-writer",
        spill: Callable[[list[Any]], None] | None = None,
        replay: Callable[[], bool] | None = None,
        backlog: Callable[[], bool] | None = None,
        give_up_after: float = 30.0,
        replay_every: float = 1.0,
        linger: float = 0.002,
        quarantine: Callable[[Any, BaseException], None] | None = None,
        is_record_error: Callable[[BaseException], bool] | None = None,
        window: float = 0.0,
        may_wait: Callable[[Any], bool] | None = None,
        write_here: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self._apply = apply
        # A due window's batch written on the putting thread (module doc, "Writing here"); with the window only.
        self._write_here = write_here if window > 0 else None
        self._here = False  # a batch is being written on a putting thread
        self._waits_here = False  # the writer waits for it
        self._here_stuck_at = -1  # ``_written`` when a write here failed: none again until it moves
        # a putting thread may take a window's batch this long before the writer would ("Writing here")
        self._early = HAND_OVER_AFTER if self._write_here is not None else 0.0
        self._wake_at = float("inf")  # when the writer is due out of its wait (module doc, "Letting in")
        self._check_ins = 0  # the writer's returns from its waits
        self._stuck_check_in = -1  # ``_check_ins`` when a letting-in timed out: none again until it moves
        # The commit window (module doc): ops ``may_wait`` accepts wait up to ``window`` s for company.
        self._may_wait = may_wait if window > 0 else None
        self._window = window
        self._urgent = False  # the buffer holds an op that may not wait, or a flush marker
        self._since = 0.0  # when the buffer's oldest op was put (monotonic)
        self._sleeping = False  # the writer waits to be told of an op (and only then is a first op's put a wake-up)
        self._streaming = False  # the writer just wrote a batch of a window: it waits one window for the next
        self._quarantine = quarantine
        self._is_record_error = is_record_error or (lambda exc: False)
        self._linger = linger
        self._linger_below = max(1, maxsize // 4)
        self._spill = spill
        self._replay = replay
        self._backlog = backlog or (lambda: False)
        self._replay_every = replay_every
        self._last_replay = 0.0
        self._maxsize = maxsize
        self._give_up_after = give_up_after
        self._name = name
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._wrote = threading.Condition(self._lock)  # a batch was written (hand-overs wait for it)
        self._checked = threading.Condition(self._lock)  # the writer is out of a wait (letting in waits for it)
        self._taken = 0  # batches the writer took
        self._written = 0  # batches it wrote (or spilled)
        self._stuck_at = -1  # ``_written`` when a hand-over timed out: none again until it moves
        self._buf: list[Any] = []  # ops, and flush markers
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, op: Any) -> None:
        batch = None
        with self._lock:
            if len(self._buf) >= self._maxsize:
                count("writer_backpressure_waits")
                while len(self._buf) >= self._maxsize and not self._closed:
                    self._not_full.wait()
            if self._closed:
                raise StoreClosedError(self._closed_message())
            self._buf.append(op)
            may_wait = self._may_wait
            if may_wait is None:
                if len(self._buf) == 1:
                    self._not_empty.notify()
            else:
                first = len(self._buf) == 1
                now = time.monotonic()
                if first:  # the window opens
                    self._since = now
                if not self._urgent and (type(op) is _Marker or not may_wait(op)
                                         or len(self._buf) >= self._linger_below):
                    self._urgent = True  # written at once, with everything before it
                    self._call_writer(now)
                elif first and self._sleeping:  # else the writer is in a window's wait, or writing: it comes by
                    self._call_writer(now)
                elif not first and threading.current_thread() is not self._thread:
                    late = now - self._since - self._window
                    if (late >= -self._early and self._write_here is not None and not self._here and not self._urgent
                            and self._taken == self._written and self._written != self._here_stuck_at
                            and not self._backlog()):
                        batch, self._buf = self._buf, []
                        self._here, self._taken = True, self._taken + 1
                        self._not_full.notify_all()
                    elif late > HAND_OVER_AFTER and self._written != self._stuck_at:
                        self._hand_over()
                if (batch is None and self._write_here is not None and now - self._wake_at > HAND_OVER_AFTER
                        and self._check_ins != self._stuck_check_in and threading.current_thread() is not self._thread):
                    self._let_in()
        if batch is not None:
            self._written_here(batch)

    def _call_writer(self, now: float) -> None:
        """Wake the writer (lock held): it is due out of its wait now."""
        self._wake_at = min(self._wake_at, now)
        self._not_empty.notify()

    def _wait(self, cond: threading.Condition, timeout: float | None = None) -> bool:
        """The writer's wait (lock held), with when it is due out of it, for letting in (module doc)."""
        self._wake_at = float("inf") if timeout is None else time.monotonic() + timeout
        try:
            return cond.wait(timeout)
        finally:
            self._wake_at = float("inf")
            self._check_ins += 1
            self._checked.notify_all()

    def _let_in(self) -> None:
        """The writer is due out of its wait and has not come out: it waits for the GIL, which it may not get
        while this thread runs Python (module doc, "Letting in"). This thread lets it go until the writer is out,
        for one window at most (and not again until it comes out). Called with the lock held."""
        target = self._check_ins + 1  # (the normal path: not counted; a writer not out in a window is)
        if not self._checked.wait_for(lambda: self._check_ins >= target or self._closed, self._window):
            self._stuck_check_in = self._check_ins
            count("writer_let_ins_timed_out")

    def _written_here(self, batch: list[Any]) -> None:
        """Write a due window's batch on this (putting) thread (module doc, "Writing here"); if that raises, the
        batch goes back to the front of the queue for the writer."""
        failed = True
        try:
            self._write_here(batch)  # type: ignore[misc]
            failed = False
        except Exception:  # never into the agent: the writer writes it (retries, spill, quarantine)
            pass
        finally:  # (an interrupt too: the batch goes back, and the writer is not left waiting for it)
            self._after_here(batch, failed)

    def _after_here(self, batch: list[Any], failed: bool) -> None:
        with self._lock:
            self._here = False
            now = time.monotonic()
            if failed:
                count("writes_here_given_back")
                self._buf[:0] = batch
                self._taken -= 1
                self._here_stuck_at = self._written
                self._urgent = True  # the writer writes it at once, with what came meanwhile
                self._call_writer(now)
            else:
                self._written += 1
            if self._waits_here:
                self._wake_at = min(self._wake_at, now)
            self._wrote.notify_all()

    def _hand_over(self) -> None:
        """The buffer's window closed and the writer has not come for it: it waits for the GIL, which it may not
        get while this thread runs Python (module doc, "Waking"). This thread lets it go until the writer has
        written the batch, for one window at most (a store that cannot be written is not waited on again until
        it writes). Called with the lock held."""
        target = self._taken + 1
        count("writer_hand_overs")
        self._not_empty.notify()
        if not self._wrote.wait_for(lambda: self._written >= target or self._closed, self._window):
            self._stuck_at = self._written

    def put_many(self, ops: list[Any]) -> None:
        """Queue ``ops`` together (one wait for room: a batch may overshoot ``maxsize`` once)."""
        with self._lock:
            while len(self._buf) >= self._maxsize and not self._closed:
                count("writer_backpressure_waits")
                self._not_full.wait()
            if self._closed:
                raise StoreClosedError(self._closed_message())
            was_empty = not self._buf
            self._buf.extend(ops)
            if self._may_wait is not None and not self._urgent:
                self._urgent = True  # an ingest's batch is written at once
                self._not_empty.notify()
            elif was_empty:
                self._not_empty.notify()

    def _closed_message(self) -> str:
        return (f"{self._name} is closed: its store was closed, so nothing more can be written through it; "
                "open the store again (open_store, or configure) to write")

    def flush(self, timeout: float | None = None) -> bool:
        """True once everything put before is applied or spilled (False on timeout)."""
        marker = self._flush(timeout)
        return marker is None or marker.event.is_set()

    def flush_applied(self, timeout: float | None = None) -> bool:
        """True once everything put before is applied; False on timeout or while it waits in a spill file."""
        marker = self._flush(timeout)
        return marker is None or (marker.event.is_set() and not marker.spilled)

    def _flush(self, timeout: float | None) -> _Marker | None:
        if threading.current_thread() is self._thread:
            return None
        with self._lock:
            if self._closed and not self._thread.is_alive():
                return None
        marker = _Marker()
        try:
            self.put(marker)
        except RuntimeError:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return marker  # not set: timed out
            return None
        marker.event.wait(timeout)
        return marker

    def close(self, timeout: float | None = 60.0) -> None:
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
            self._wrote.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def pending(self) -> int:
        return len(self._buf)

    def _run(self) -> None:
        while True:
            with self._lock:
                streamed = False
                while not self._buf and not self._closed:
                    if self._replay is not None and self._backlog():
                        # Idle with a backlog: wake up now and then to write it back (and when told of an op).
                        streamed, self._sleeping = False, True
                        try:
                            woken = self._wait(self._not_empty, self._replay_every)
                        finally:
                            self._sleeping = False
                        if not woken and not self._buf:
                            break
                    elif self._streaming:
                        # A window's batch was just written: wait one window for the next ops instead of being
                        # woken by the first (module doc, "Waking"); what comes meanwhile waited less than one.
                        self._streaming = False
                        self._wait(self._not_empty, self._window)
                        # (with writes here, what came still waits its window, for a putting thread to take it)
                        streamed = self._write_here is None
                    else:
                        streamed = False  # an op that wakes this wait waits its window below
                        self._sleeping = True
                        try:
                            self._wait(self._not_empty)
                        finally:
                            self._sleeping = False
                while (self._buf and not streamed and not self._urgent and not self._closed
                       and self._may_wait is not None):
                    # only ops that may wait: until the window closes, or an urgent op or a full batch comes
                    left = self._since + self._window - time.monotonic()
                    if left <= 0:
                        break
                    self._wait(self._not_empty, left)
                while self._here:  # a batch written on a putting thread goes first (and may come back)
                    self._waits_here = True
                    try:
                        self._wait(self._wrote)
                    finally:
                        self._waits_here = False
                if not self._buf:
                    if self._closed:
                        return
                    batch = []
                else:
                    batch, self._buf = self._buf, []
                    # a batch its window closed on (no flush, no finish waiting for it): the stream goes on
                    windowed = not self._urgent and self._may_wait is not None
                    self._urgent = False
                    self._taken += 1
                    self._not_full.notify_all()
            if not batch:
                self._try_replay()
                continue
            self._apply_with_retry(batch)
            self._streaming = windowed
            if self._may_wait is not None:
                with self._lock:
                    self._written += 1
                    self._wrote.notify_all()
            if len(batch) < self._linger_below and not self._closed and self._may_wait is None:
                # Small batches: wait a moment so that the next one is bigger and producers rarely
                # have to wake this thread (a flush marker still goes through within a few ms).
                time.sleep(self._linger)

    def write(self, items: list[Any]) -> None:
        """Apply the ops ``items``, setting aside those that fail for a reason in their own data (halves,
        recursively, down to single ops, which are quarantined). Raises what is not the records'
        fault (the store cannot be written): the caller retries or spills, idempotently."""
        try:
            self._apply(items)
            return
        except Exception as exc:
            if self._quarantine is None or not self._is_record_error(exc):
                raise
            if len(items) == 1:
                self._quarantine(items[0], exc)  # counts it (once, however often a batch is retried)
                return
        half = len(items) // 2
        self.write(items[:half])
        self.write(items[half:])

    def _try_replay(self) -> bool:
        """Write the backlog back (at most every ``replay_every`` s). True when none is left."""
        if self._replay is None or not self._backlog():
            return True
        now = time.monotonic()
        if now - self._last_replay < self._replay_every:
            return False
        self._last_replay = now
        try:
            return self._replay()
        except Exception as exc:
            report_failure("spill replay", exc)
            return False

    def _spill_or_retry(self, items: list[Any]) -> bool:
        try:
            self._spill(items)
        except Exception as spill_exc:  # keep retrying: dropping is not an option
            report_failure("spill", spill_exc)
            return False
        count("spilled_batches")
        return True

    def _apply_with_retry(self, batch: list[Any]) -> None:
        markers = [op for op in batch if type(op) is _Marker]
        items = [op for op in batch if type(op) is not _Marker] if markers else batch
        spilled = False
        # The backlog is tried on its timer whatever this batch holds: a process whose traffic is only
        # flushes (a trainer reading what it wrote) never goes idle, and must still write it back.
        replayed = self._try_replay() if self._spill is not None else True
        if items and not replayed:
            # A backlog is waiting: nothing may overtake it, so this batch goes behind it.
            spilled = self._spill_or_retry(items)
        deadline = time.monotonic() + self._give_up_after
        delay = 0.02
        while items and not spilled:
            try:
                self.write(items)
                break
            except Exception as exc:
                report_failure("store write", exc)
                if time.monotonic() >= deadline and self._spill is not None:
                    spilled = self._spill_or_retry(items)
                    if spilled:
                        self._last_replay = time.monotonic()
                        break
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        backlog = self._backlog() if self._replay is not None else spilled
        for marker in markers:
            marker.spilled = backlog
            marker.event.set()
