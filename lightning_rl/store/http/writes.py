"""The HTTP store's transport and write path.

:class:`ServerList`: the store servers a client may use and the one it uses now; a request goes to
that one, then to each other in turn while they fail. :class:`BatchSender`: the writer's ops encoded as
wire JSON, posted in batches, spilled to a local file while no server answers, and replayed from it,
oldest first, before anything newer. A batch a server refuses (4xx) is kept in a ``rejected-*`` file
with the reason (``http/client.py`` describes the behaviour a runner sees)."""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

import httpx
import orjson

from ...boundaries import safe_text
from ...diagnostics import count, report_failure
from ...errors import ConfigurationError
from .. import wire
from ..uri import redacted
from ..ops import Op
from ..spill import SpillFiles

_RETRY_DELAYS = (0.05, 0.2, 0.5)  # a batch is spilled after these (about 0.75 s of trying)
PROBE_EVERY = 0.5  # while spilling, the server is tried again at most this often
# A write the agent may be waiting for (its rollout's flush) gets about a second in all, also when
# the server accepts connections and never answers; so does a probe of a server that was away.
_WRITE_BUDGET = 1.0
_QUICK = httpx.Timeout(1.0, connect=0.5)
_PROBE = httpx.Timeout(0.5, connect=0.5)
_BATCH_BYTES = 8 * 2**20


class _Unreachable(Exception):
    """No server answered (connection refused or reset, timeout, 5xx, 408, 429): spill and retry later."""


class _NoStoreServer(_Unreachable):
    """Every URL answered, and none as a store server does (a 404 or 405 without a store server's error body:
    the URL is the viewer's, an engine's, anything else's). Writes are kept (spilled) all the same."""


def is_outage(status: int) -> bool:
    """An answer that says the server, not the request, is the problem: try another, or later."""
    return status >= 500 or status in (408, 429)


def is_foreign(resp: httpx.Response) -> bool:
    """An answer no store server gives: a 404 or 405 whose body is not a store server's error
    (``{"error": ...}``), so the URL is not ``lightning-rl store serve`` (or not its address: no ``/v1``)."""
    if resp.status_code not in (404, 405):
        return False
    try:
        body = orjson.loads(resp.content)
    except orjson.JSONDecodeError:
        return True
    return not (isinstance(body, dict) and "error" in body)


class ServerList:
    """The store servers (``urls``, all serving one store) a client may use, and the one it uses now.

    :meth:`send` asks the current server, then each other in turn (wrapping around), and stays with the
    first that gives an answer that is not an outage; a move is counted (``store_server_failovers``) and
    logged once. Shared by the writer thread and the caller's threads."""

    def __init__(self, urls: list[str], **client_args: object) -> None:
        self.urls = urls
        self._client_args = client_args
        self._clients = [httpx.Client(base_url=url + wire.API_PREFIX, **client_args) for url in urls]
        self._current = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self.urls[self._current]

    def renewed(self) -> "ServerList":
        """The same servers on new connections (a forked child's own), starting with the current one."""
        fresh = ServerList(self.urls, **self._client_args)
        fresh._current = self._current
        return fresh

    def send(self, method: str, path: str, *, content: bytes | None = None, params: dict | None = None,
             timeout: httpx.Timeout | None = None) -> httpx.Response:
        """The first answer that is not an outage, from the current server or, in turn, the others;
        :class:`_Unreachable` naming each server's problem when none gave one."""
        start = self._current
        problems = []
        foreign = 0
        extra = {} if timeout is None else {"timeout": timeout}
        for step in range(len(self.urls)):
            index = (start + step) % len(self.urls)
            try:
                resp = self._clients[index].request(method, path, content=content, params=params, **extra)
            except httpx.HTTPError as exc:
                problems.append(f"{self.urls[index]}: {type(exc).__name__}: {exc}")
                continue
            if is_outage(resp.status_code):
                problems.append(f"{self.urls[index]}: HTTP {resp.status_code}: {resp.text[:200]}")
                continue
            if is_foreign(resp):
                foreign += 1
                problems.append(f"{self.urls[index]} is not a lightning-rl store server (HTTP {resp.status_code} on "
                                f"{wire.API_PREFIX}{path}: {resp.text[:100]})")
                continue
            if index != start:
                self._moved(start, index, problems)
            return resp
        raise (_NoStoreServer if foreign == len(self.urls) else _Unreachable)("; ".join(problems))

    def _moved(self, start: int, index: int, problems: list[str]) -> None:
        with self._lock:
            if self._current != start:  # another thread moved on meanwhile: keep its choice
                return
            self._current = index
        count("store_server_failovers")
        report_failure("store server failover", message=(
            f"lightning-rl: store server failed ({'; '.join(problems)[:300]}); using {self.urls[index]} now "
            "(logged once; counted as store_server_failovers)"))

    def close(self) -> None:
        for client in self._clients:
            client.close()


def server_urls(url: str | list[str] | tuple[str, ...]) -> list[str]:
    """The servers of a client: a list, or one string with commas (``http://a:8765,http://b:8765``)."""
    urls: list[str] = []
    for part in url.split(",") if isinstance(url, str) else url:
        parts = urlsplit(part.strip()) if isinstance(part, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(f"store server URL {redacted(str(part))!r:.200} is not an http(s)://HOST:PORT URL of `lightning-rl "
                                     "store serve` (several: comma-separated, http://a:8765,http://b:8765)")
        clean = part.strip().rstrip("/")
        if clean not in urls:
            urls.append(clean)
    if not urls:
        raise ConfigurationError(f"no store server URL in {redacted(str(url))!r:.200}; give http://HOST:PORT")
    return urls


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
    """Sends the ops of one process's writer to ``servers``; ``spill`` keeps what could not be sent.
    ``latencies``: seconds per accepted batch request (bench and reliability figures)."""

    def __init__(self, servers: ServerList, spill: SpillFiles, *, batch_ops: int, timeout: httpx.Timeout) -> None:
        self._servers = servers
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
                report_failure("store server unreachable", message=f"lightning-rl: no store server of "
                               f"{','.join(self._servers.urls)} answered ({str(exc)[:500]}); spilling to "
                               f"{self.spill.folder} (replayed when one answers)")
                self.spill.append(ops[start:])
                return

    def replay(self, force: bool = False) -> bool:
        """Send the spill files, oldest first. True when none is left. The first request is a short
        probe; once the server has answered, the rest go with the normal timeout."""
        if not force and time.monotonic() - self.spill.last_failure < PROBE_EVERY:
            return False
        timeout, budget = _PROBE, 0.0
        while self.spill.files:
            with self.spill.lock:  # an erasure does not rewrite a file while it is replayed
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
        """POST one batch to a server that answers (``ServerList.send``: the current one, then the others),
        retrying within ``budget`` seconds (each request under ``timeout``). Every op is idempotent, so a
        batch a failed server may have committed can be sent again to the next."""
        body = wire.batch_body(ops)
        last: Exception | None = None
        deadline = time.monotonic() + budget
        for delay in (*_RETRY_DELAYS, None):
            t0 = time.perf_counter()
            try:
                resp = self._servers.send("POST", "/batch", content=body, timeout=timeout)
            except _Unreachable as exc:
                last = exc
            else:
                if resp.status_code < 300:
                    with self._lat_lock:
                        self.latencies.append(time.perf_counter() - t0)
                    return
                raise _Rejected(resp.status_code, resp.text[:2000])
            if delay is None or time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
        raise _Unreachable(str(last))
