"""A pool of sandboxes per snapshot: warm ones handed out after a liveness check, at most ``size`` in use or idle,
at most ``max_starting`` starting at once (a crowd of starts is what overloads a daemon), a deadline on each start,
reset on return (copy-on-write: milliseconds), and the counts on every batch's metrics line.

A sandbox's lifetime in the pool is the try's deadline plus ``lifetime_margin`` (stated, never equal to the
deadline: a lifetime equal to it kills long tries at their last step); one held past it is taken back and closed,
and its try then fails as infrastructure (``SandboxError``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..diagnostics import count
from ..errors import ConfigurationError, SandboxError
from .backends import open_sandbox
from .base import Limits
from .layers import Snapshot

#: The pool's counts (this process's counters; put on every batch's metrics line under "sandbox").
SANDBOX_METRICS = ("sandbox_started", "sandbox_reused", "sandbox_start_failed", "sandbox_dead_on_checkout",
                   "sandbox_killed_at_deadline", "sandbox_expired", "sandbox_reset_ms_total", "sandbox_resets",
                   "sandbox_infra_retries", "sandbox_protected_restored", "sandbox_commands",
                   "sandbox_commands_failed", "sandbox_output_cut_bytes")


class SandboxPool:
    """Sandboxes of one ``snapshot`` (a :class:`Snapshot`) on ``backend``. ``acquire()`` (a context manager; async:
    ``acquire_async``) gives one: an idle warm one if alive, else a new one (waiting while ``size`` are out);
    leaving the block resets it and puts it back (closed instead when its try broke it: ``lease.broken = True``).
    ``warm``: how many are started ahead by ``prewarm()``."""

    def __init__(self, snapshot: Snapshot, *, backend: str = "bwrap", size: int = 8, warm: int = 0,
                 max_starting: int = 4, start_timeout: float = 60.0, try_timeout: float = 600.0,
                 lifetime_margin: float = 60.0, limits: Limits | None = None, **backend_options: Any) -> None:
        for name, value in (("size", size), ("max_starting", max_starting)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"SandboxPool({name}={value!r}): give a whole number >= 1")
        if not isinstance(warm, int) or not 0 <= warm <= size:
            raise ConfigurationError(f"SandboxPool(warm={warm!r}): give a whole number from 0 to size ({size})")
        for name, value in (("start_timeout", start_timeout), ("try_timeout", try_timeout),
                            ("lifetime_margin", lifetime_margin)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(f"SandboxPool({name}={value!r}): give seconds, > 0")
        self.snapshot, self.backend, self.size, self.warm = snapshot, backend, size, warm
        self.start_timeout, self.try_timeout, self.lifetime_margin = start_timeout, try_timeout, lifetime_margin
        self.limits, self.options = limits, backend_options
        self._slots = threading.BoundedSemaphore(size)
        self._starting = threading.BoundedSemaphore(max_starting)
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._out: dict[int, tuple[Any, float]] = {}  # id(sandbox) -> (sandbox, expiry)
        self.starting_now = self.most_starting = 0
        self.closed = False
        self.owns_snapshot = False

    @property
    def lifetime(self) -> float:
        """How long a handed-out sandbox lives: the try's deadline plus the margin."""
        return self.try_timeout + self.lifetime_margin

    def _start(self) -> Any:
        if not self._starting.acquire(timeout=self.start_timeout):
            count("sandbox_start_failed")
            raise SandboxError(f"no sandbox could start within {self.start_timeout:g} s: {self.most_starting} were "
                               "starting at once; raise start_timeout or lower the concurrency")
        with self._lock:
            self.starting_now += 1
            self.most_starting = max(self.most_starting, self.starting_now)
        began = time.monotonic()
        try:
            box = open_sandbox(self.backend, snapshot=self.snapshot, limits=self.limits, **self.options)
        except ConfigurationError:
            raise
        except Exception as exc:
            count("sandbox_start_failed")
            raise exc if isinstance(exc, SandboxError) else SandboxError(f"the sandbox could not start: {exc}") from exc
        finally:
            with self._lock:
                self.starting_now -= 1
            self._starting.release()
        if time.monotonic() - began > self.start_timeout:
            box.close()
            count("sandbox_start_failed")
            raise SandboxError(f"the sandbox took {time.monotonic() - began:.1f} s to start, past start_timeout="
                               f"{self.start_timeout:g} s")
        count("sandbox_started")
        return box

    def prewarm(self) -> int:
        """Start sandboxes until ``warm`` are idle; returns how many were started."""
        started = 0
        while len(self._idle) < self.warm and self._slots.acquire(blocking=False):
            try:
                box = self._start()
            except BaseException:
                self._slots.release()
                raise
            with self._lock:
                self._idle.append(box)
            self._slots.release()
            started += 1
        return started

    def _checkout(self, timeout: float | None) -> Any:
        self._reap()
        if self.closed:
            raise SandboxError("this sandbox pool is closed")
        if not self._slots.acquire(timeout=timeout):  # None: wait for one (a Semaphore takes -1 as "not at all")
            raise SandboxError(f"no sandbox was free within {timeout:g} s ({self.size} in use); raise the pool's size")
        try:
            box = None
            while box is None:
                with self._lock:
                    candidate = self._idle.pop() if self._idle else None
                if candidate is None:
                    box = self._start()
                elif candidate.alive():
                    box = candidate
                    count("sandbox_reused")
                else:
                    count("sandbox_dead_on_checkout")
                    candidate.close()
            with self._lock:
                self._out[id(box)] = (box, time.monotonic() + self.lifetime)
            return box
        except BaseException:
            self._slots.release()
            raise

    def _checkin(self, box: Any, broken: bool) -> None:
        with self._lock:
            held = self._out.pop(id(box), None)
        if held is None:  # taken back at its expiry
            return
        try:
            if broken or self.closed or not box.alive():
                box.close()
                return
            try:
                took = box.reset()
            except Exception:
                box.close()
                return
            count("sandbox_resets")
            count("sandbox_reset_ms_total", round(took * 1000))
            with self._lock:
                self._idle.append(box)
        finally:
            self._slots.release()

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(key, box) for key, (box, until) in self._out.items() if until < now]
            for key, _ in expired:
                del self._out[key]
        for _, box in expired:
            count("sandbox_expired")
            box.close()
            self._slots.release()

    @contextlib.contextmanager
    def acquire(self, timeout: float | None = None) -> Iterator[Any]:
        """A sandbox for one try (reset and returned when the block ends; closed if ``broken`` was set on it)."""
        box = self._checkout(timeout)
        box.broken = False
        try:
            yield box
        except SandboxError:
            box.broken = True
            raise
        finally:
            self._checkin(box, getattr(box, "broken", False))

    @contextlib.asynccontextmanager
    async def acquire_async(self, timeout: float | None = None):  # type: ignore[no-untyped-def]
        """``acquire`` for a coroutine. The wait for a free sandbox blocks a thread of its own, never one of the
        loop's default executor: with its few threads all waiting, the give-back that frees one queued behind them
        (a stall for good). A wait cancelled before its sandbox comes gives that sandbox back when it comes."""
        box = await _in_own_thread(self._checkout, timeout, on_abandoned=lambda box: self._checkin(box, False))
        box.broken = False
        try:
            yield box
        except SandboxError:
            box.broken = True
            raise
        finally:
            await _in_own_thread(self._checkin, box, getattr(box, "broken", False))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"idle": len(self._idle), "in_use": len(self._out), "most_starting": self.most_starting}

    def close(self) -> None:
        self.closed = True
        with self._lock:
            boxes = self._idle + [box for box, _ in self._out.values()]
            self._idle, self._out = [], {}
        for box in boxes:
            box.close()
        if self.owns_snapshot:  # built from a spec (pool_from_spec): its snapshot is this pool's
            self.snapshot.close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What a pool spec (``pool_from_spec``) may hold besides the pool's own options.
_SNAPSHOT_KEYS = ("folder", "setup", "setup_timeout", "setup_network", "max_files", "max_mb")


def pool_from_spec(spec: dict[str, Any]) -> SandboxPool:
    """A pool built here from a plain description (what a Ray actor or a runner process is given: a pool holds
    processes and folders of one machine, so each builds its own): ``folder`` and the snapshot's options
    (``setup``, ``setup_timeout``, ``setup_network``, ``max_files``, ``max_mb``), ``limits`` (a dict of
    :class:`Limits` fields), and the pool's (``backend``, ``size``, ``warm``, ...)."""
    if not isinstance(spec, dict) or "folder" not in spec:
        raise ConfigurationError(f"a sandbox pool spec is a dict with at least 'folder' (the task's folder), got "
                                 f"{spec!r}")
    snap_options = {k: spec[k] for k in _SNAPSHOT_KEYS if k in spec and k != "folder"}
    rest = {k: v for k, v in spec.items() if k not in _SNAPSHOT_KEYS}
    if isinstance(rest.get("limits"), dict):
        rest["limits"] = Limits(**rest["limits"])
    snapshot = Snapshot(spec["folder"], backend=rest.get("backend", "bwrap"), **snap_options)
    try:
        pool = SandboxPool(snapshot, **rest)
    except BaseException:
        snapshot.close()
        raise
    pool.owns_snapshot = True
    pool.prewarm()
    return pool


class PoolPerTask:
    """A pool per task, for a task family whose tasks each have a folder of their own (``Runner(sandboxes=...)``
    takes it: each try's sandbox comes from its task's pool). ``folder_of(task)`` gives ``(key, folder)``: the
    snapshot is made once per key (with ``setup``), its pool kept while at most ``max_pools`` are (the least
    recently used beyond that is closed)."""

    def __init__(self, folder_of: Any, *, setup: Any = None, max_pools: int = 32, **pool_options: Any) -> None:
        self.folder_of, self.setup, self.max_pools, self.options = folder_of, setup, max_pools, pool_options
        self._pools: dict[Any, SandboxPool] = {}
        self._lock = threading.Lock()

    def __call__(self, task: Any) -> SandboxPool:
        with self._lock:  # folder_of may write the folder: never while another try's snapshot copies it
            key, folder = self.folder_of(task)
            pool = self._pools.pop(key, None)
            if pool is None:
                snapshot = Snapshot(folder, setup=self.setup, backend=self.options.get("backend", "bwrap"))
                pool = SandboxPool(snapshot, **self.options)
                pool.owns_snapshot = True
            self._pools[key] = pool  # the most recently used last
            stale = list(self._pools)[: max(len(self._pools) - self.max_pools, 0)]
            closing = [self._pools.pop(k) for k in stale]
        for old in closing:
            old.close()
        return pool

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


async def _in_own_thread(fn: Any, *args: Any, on_abandoned: Any = None) -> Any:
    """``fn(*args)`` in a new thread, awaited; if the awaiting task is cancelled, its result goes to
    ``on_abandoned`` when it comes."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            done.set_exception(exc)

    threading.Thread(target=run, name="lightning-rl-sandbox-wait", daemon=True).start()
    try:
        return await asyncio.shield(asyncio.wrap_future(done))
    except asyncio.CancelledError:
        if on_abandoned is not None:
            done.add_done_callback(lambda f: f.exception() is None and on_abandoned(f.result()))
        raise
