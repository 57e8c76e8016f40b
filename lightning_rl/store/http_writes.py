"""The HTTP store's write path: the writer's ops encoded as wire JSON, posted in batches, spilled to a
local file while the server does not answer, and replayed from it, oldest first, before anything newer.
A batch the server refuses (4xx) is kept in a ``rejected-*`` file with the reason (``http_store.py``
describes the behaviour a runner sees)."""

from __future__ import annotations

import threading
import time

import httpx
import orjson

from ..boundaries import safe_text
from ..diagnostics import count, report_failure
from ..errors import StoreError
from . import wire
from .ops import Op
from .spill import SpillFiles

_RETRY_DELAYS = (0.05, 0.2, 0.5)  # a batch is spilled after these (about 0.75 s of trying)
PROBE_EVERY = 0.5  # while spilling, the server is tried again at most this often
# A write the agent may be waiting for (its rollout's flush) gets about a second in all, also when
# the server accepts connections and never answers; so does a probe of a server that was away.
_WRITE_BUDGET = 1.0
_QUICK = httpx.Timeout(1.0, connect=0.5)
_PROBE = httpx.Timeout(0.5, connect=0.5)
_BATCH_BYTES = 8 * 2**20


class _Unreachable(Exception):
    """The server did not answer (connection refused, timeout, 5xx): spill and retry later."""


class _Rejected(Exception):
    """The server refused the content (4xx): keep it aside with the reason; retrying cannot help."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.invalid_ops: list[int] | None = None  # the ops the server named (a refused batch), if it did
        try:
            named = orjson.loads(body).get("invalid_ops")
        except (orjson.JSONDecodeError, AttributeError):
            named = None
        if isinstance(named, list) and named and all(isinstance(i, int) and not isinstance(i, bool) for i in named):
            self.invalid_ops = named


class Replay:
    """Put on the writer's queue to wake it: it tries the spilled backlog again."""

    __slots__ = ()


REPLAY = Replay()


class BatchSender:
    """Sends the ops of one process's writer to ``url`` through ``client``; ``spill`` keeps what could not
    be sent. ``latencies``: seconds per accepted batch request (bench and reliability figures)."""

    def __init__(self, client: httpx.Client, url: str, spill: SpillFiles, *, batch_ops: int,
                 timeout: httpx.Timeout) -> None:
        self._client = client
        self.url = url
        self.spill = spill
        self._batch_ops = batch_ops
        self._timeout = timeout
        self.latencies: list[float] = []
        self._lat_lock = threading.Lock()

    def send(self, items: list[Op | Replay]) -> None:
        """Send one writer batch, or spill it. Never raises: every op ends on the server or on disk (a
        record that cannot even be encoded is kept in a ``rejected-*`` file with the reason)."""
        ops = []
        for op in items:
            if op is REPLAY:
                continue
            try:
                ops.append(wire.encode(op))
            except Exception as exc:  # JSON cannot hold it: set aside, described, never retried
                self._set_aside([orjson.dumps({"op": op.kind, "unencodable": safe_text(op)})],
                                f"{op.kind} could not be encoded: {type(exc).__name__}: {exc}")
        if self.spill.files and not self.replay():
            if ops:
                self.spill.append(ops)
            return
        for start in range(0, len(ops), self._batch_ops):
            chunk = ops[start:start + self._batch_ops]
            try:
                self._post_ops(chunk)
            except _Unreachable as exc:
                self.spill.last_failure = time.monotonic()
                report_failure("store server unreachable", message=f"lightning-rl: store server {self.url} "
                               f"unreachable ({exc}); spilling to {self.spill.folder} (replayed when it returns)")
                self.spill.append(ops[start:])
                return

    def replay(self, force: bool = False) -> bool:
        """Send the spill files, oldest first. True when none is left. The first request is a short
        probe; once the server has answered, the rest go with the normal timeout."""
        if not force and time.monotonic() - self.spill.last_failure < PROBE_EVERY:
            return False
        timeout, budget = _PROBE, 0.0
        while self.spill.files:
            path = self.spill.files[0]
            try:
                ops = SpillFiles.read(path)
                for start in range(0, len(ops), self._batch_ops):
                    self._post_ops(ops[start:start + self._batch_ops], timeout=timeout, budget=budget)
                    timeout, budget = self._timeout, _WRITE_BUDGET
            except _Unreachable:
                self.spill.last_failure = time.monotonic()
                return False
            except OSError as exc:
                report_failure("spill replay", exc)
                self.spill.last_failure = time.monotonic()
                return False
            path.unlink()
            self.spill.files.pop(0)
            count("spill_files_replayed")
        return True

    def _post_ops(self, ops: list[bytes], *, timeout: httpx.Timeout = _QUICK, budget: float = _WRITE_BUDGET) -> None:
        """POST ops as batches under the size bound; 4xx batches are set aside (split first if 413)."""
        batches, current, size = [], [], 0
        for op in ops:
            if current and size + len(op) > _BATCH_BYTES:
                batches.append(current)
                current, size = [], 0
            current.append(op)
            size += len(op) + 1
        if current:
            batches.append(current)
        for batch in batches:
            try:
                self._post_batch(batch, timeout=timeout, budget=budget)
            except _Rejected as exc:
                named = [i for i in exc.invalid_ops or () if 0 <= i < len(batch)]
                if named and len(named) < len(batch):  # set aside the ops the server named; send the rest again
                    self._set_aside([batch[i] for i in named], str(exc))
                    bad = set(named)
                    self._post_ops([op for i, op in enumerate(batch) if i not in bad], timeout=timeout, budget=budget)
                    continue
                if exc.status in (413, 422) and len(batch) > 1:  # too big, or the server did not say which op
                    half = len(batch) // 2
                    self._post_ops(batch[:half], timeout=timeout, budget=budget)
                    self._post_ops(batch[half:], timeout=timeout, budget=budget)
                    continue
                self._set_aside(batch, str(exc))

    def _set_aside(self, ops: list[bytes], reason: str) -> None:
        """Ops the server refused (or that cannot be encoded) in a ``rejected-*`` file with the reason."""
        where = self.spill.reject(ops, reason)
        report_failure("store server refused a batch", message=(
            f"lightning-rl: the store server refused {len(ops)} records ({reason[:500]}); kept in {where}, "
            "the rest of their batch was sent (logged once; counted as rejected_ops)"))

    def _post_batch(self, ops: list[bytes], *, timeout: httpx.Timeout, budget: float) -> None:
        """POST one batch, retrying within ``budget`` seconds (each request under ``timeout``)."""
        body = wire.batch_body(ops)
        last: Exception | None = None
        deadline = time.monotonic() + budget
        for delay in (*_RETRY_DELAYS, None):
            t0 = time.perf_counter()
            try:
                resp = self._client.post("/batch", content=body, timeout=timeout)
            except httpx.HTTPError as exc:
                last = exc
            else:
                if resp.status_code < 300:
                    with self._lat_lock:
                        self.latencies.append(time.perf_counter() - t0)
                    return
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise _Rejected(resp.status_code, resp.text[:2000])
                last = StoreError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            if delay is None or time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
        raise _Unreachable(f"{type(last).__name__}: {last}")
