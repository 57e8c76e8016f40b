"""A background writer with a bounded queue: batches items, applies back-pressure, never drops.

Producers call ``put``; when the queue holds ``maxsize`` items they wait (back-pressure) instead of
dropping anything. The writer thread takes everything queued as one batch and hands it to
``apply``. A batch that keeps failing is retried with backoff for ``give_up_after`` seconds and then
handed to ``spill`` (a file next to the store) so that it is kept, never silently lost.
``flush`` returns once everything put before it has been applied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..diagnostics import count, report_failure

FLUSH = "flush"


class BackgroundWriter:
    def __init__(
        self,
        apply: Callable[[list[tuple[str, Any]]], None],
        *,
        maxsize: int = 8192,
        name: str = "lightning-rl-writer",
        spill: Callable[[list[tuple[str, Any]]], None] | None = None,
        give_up_after: float = 30.0,
        linger: float = 0.002,
    ) -> None:
        self._apply = apply
        self._linger = linger
        self._linger_below = max(1, maxsize // 4)
        self._spill = spill
        self._maxsize = maxsize
        self._give_up_after = give_up_after
        self._name = name
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._buf: list[tuple[str, Any]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, kind: str, payload: Any) -> None:
        with self._lock:
            if len(self._buf) >= self._maxsize:
                count("writer_backpressure_waits")
                while len(self._buf) >= self._maxsize and not self._closed:
                    self._not_full.wait()
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            self._buf.append((kind, payload))
            if len(self._buf) == 1:
                self._not_empty.notify()

    def put_many(self, items: list[tuple[str, Any]]) -> None:
        """Queue ``items`` together (one wait for room: a batch may overshoot ``maxsize`` once)."""
        with self._lock:
            while len(self._buf) >= self._maxsize and not self._closed:
                count("writer_backpressure_waits")
                self._not_full.wait()
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            was_empty = not self._buf
            self._buf.extend(items)
            if was_empty:
                self._not_empty.notify()

    def flush(self, timeout: float | None = None) -> bool:
        if threading.current_thread() is self._thread:
            return True
        event = threading.Event()
        with self._lock:
            if self._closed and not self._thread.is_alive():
                return True
        try:
            self.put(FLUSH, event)
        except RuntimeError:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return event.wait(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def pending(self) -> int:
        return len(self._buf)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._buf and not self._closed:
                    self._not_empty.wait()
                if not self._buf:
                    return
                batch, self._buf = self._buf, []
                self._not_full.notify_all()
            self._apply_with_retry(batch)
            if len(batch) < self._linger_below and not self._closed:
                # Small batches: wait a moment so that the next one is bigger and producers rarely
                # have to wake this thread (a flush marker still goes through within a few ms).
                time.sleep(self._linger)

    def _apply_with_retry(self, batch: list[tuple[str, Any]]) -> None:
        events = [payload for kind, payload in batch if kind == FLUSH]
        items = [item for item in batch if item[0] != FLUSH] if events else batch
        deadline = time.monotonic() + self._give_up_after
        delay = 0.02
        while items:
            try:
                self._apply(items)
                break
            except Exception as exc:
                report_failure("store write", exc)
                if time.monotonic() >= deadline and self._spill is not None:
                    try:
                        self._spill(items)
                        count("spilled_batches")
                        break
                    except Exception as spill_exc:  # keep retrying: dropping is not an option
                        report_failure("spill", spill_exc)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        for event in events:
            event.set()
