"""The gateway's hop to its engines: a lean HTTP/1.1 client with a keep-alive pool per engine.

One POST with a JSON body, the answer read whole or as it arrives: that is all the gateway asks of
this hop, on every call, so it is built on asyncio's protocol layer and ``httptools`` (the C parser
uvicorn already uses) rather than a general client. Under load httpx spent half of the gateway's CPU
on this hop (its pool probes every idle connection on every request); this spends a few percent
(docs/benchmarks.md section 12).

* ``Upstream(url).post(path, body, stream=...)`` answers once the engine's status and headers are in.
  ``Response.read()`` reads the rest; ``Response.iter_bytes()`` yields it as it arrives;
  ``Response.close()`` gives the connection back to the pool (or closes it, mid-answer);
  ``Response.abort()`` closes it from another task (the client hung up), which ends a reader there.
* Every failure to reach the engine or to read its answer (refused, reset, timed out, bad HTTP) is
  an ``UpstreamError``, so the gateway can mark the engine down and try the next. A kept-alive
  connection the engine closed while idle is retried once on a fresh one, before anything was read.
* ``timeout`` bounds each wait for the engine (connecting, the headers, each piece of the body), as
  httpx's read timeout did; a stream that keeps flowing may run longer.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import httptools

from ..errors import UpstreamError

_HIGH_WATER = 1 << 20  # pause reading from the engine while this much of its answer is unread


class _Connection(asyncio.Protocol):
    """One connection to an engine, carrying one request at a time (HTTP/1.1 keep-alive)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.headers_done = self.complete = self.keep_alive = self.got_bytes = self.paused = False
        self.error: UpstreamError | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamError(f"the engine's answer is not valid HTTP: {exc}"))
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = UpstreamError("the engine closed the connection" + (f": {exc}" if exc else ""))
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # -- the request --------------------------------------------------------------------------------
    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until something arrives (or the connection ends); an error if nothing came in ``timeout``."""
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._timed_out, waiter, timeout)
        try:
            await waiter
        finally:
            timer.cancel()

    def _timed_out(self, waiter: asyncio.Future, timeout: float) -> None:
        if not waiter.done():
            self.fail(UpstreamError(f"the engine sent nothing for {timeout:g} s (the gateway's timeout)"))

    def take(self) -> bytes:
        piece = self.chunks.popleft()
        self.buffered -= len(piece)
        if self.paused and self.buffered <= _HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return piece


class Response:
    """An engine's answer: status and headers now, the body by ``read`` or ``iter_bytes``."""

    def __init__(self, pool: Upstream, conn: _Connection) -> None:
        self._pool, self._conn = pool, conn
        self.status_code = conn.status
        self.headers = conn.headers
        self._done = False

    async def read(self) -> bytes:
        """The rest of the body; the connection goes back to the pool."""
        try:
            return b"".join([piece async for piece in self.iter_bytes()])
        finally:
            self.close()

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            while conn.chunks:
                yield conn.take()
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._pool.timeout)

    def close(self) -> None:
        """Give the connection back for the next request, or close it if the answer was not read to its end."""
        if self._done:
            return
        self._done = True
        self._pool._release(self._conn)

    def abort(self) -> None:
        """Close the connection now (the engine stops generating); a reader in another task gets an error.
        Nothing once the answer is done (the connection may be serving another request by then)."""
        if self._done:
            return
        self._done = True
        self._conn.fail(UpstreamError("the gateway closed the connection (its client hung up)"))


class Upstream:
    """A keep-alive pool of connections to one engine (``url``: ``http(s)://host[:port][/prefix]``)."""

    def __init__(self, url: str, *, timeout: float = 600.0, connect_timeout: float = 10.0, max_idle: int = 512) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.rpartition("@")[2]
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.timeout, self.connect_timeout, self.max_idle = timeout, connect_timeout, max_idle
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(loop), self.host, self.port, ssl=self._ssl), self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}: {exc}") from None
        return conn

    async def post(self, path: str, body: bytes, *, stream: bool) -> Response:
        """Send ``body`` (JSON) to ``path``; the answer once its status and headers are in."""
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Accept: {'text/event-stream' if stream else 'application/json'}\r\n\r\n").encode("latin-1")
        while True:
            conn = None
            while self._idle and conn is None:
                conn = self._idle.pop()
                if conn.closed:
                    conn = None
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            conn._reset()
            conn.transport.write(head + body)
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(self.timeout)
            except UpstreamError:
                if reused and not conn.got_bytes:  # the engine had closed this idle connection: a fresh one
                    continue
                raise
            except BaseException:  # cancelled: the answer will never be read
                conn.fail(UpstreamError("the request was cancelled"))
                raise
            return Response(self, conn)

    def _release(self, conn: _Connection) -> None:
        if conn.complete and conn.keep_alive and not conn.closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        elif not conn.closed:
            conn.fail(UpstreamError("closed before the answer was read to its end"))

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.fail(UpstreamError("the gateway is shutting down"))
