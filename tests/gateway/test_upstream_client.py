"""The gateway's hop to its engines (gateway/upstream.py), against a real socket server that misbehaves
on purpose: each way an engine can fail ends in an UpstreamError (so the gateway can try the next
engine), and a kept-alive connection is reused, or replaced when the engine dropped it."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("httptools")

from lightning_rl.errors import UpstreamError  # noqa: E402
from lightning_rl.gateway.upstream import Upstream  # noqa: E402

BODY = b'{"model": "m"}'


class Engine:
    """An asyncio TCP server; ``answer(reader, writer, n)`` handles the n-th request (0-based)."""

    def __init__(self, answer):
        self.answer, self.connections, self.requests = answer, 0, 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                assert await reader.readexactly(length) == BODY
                n, self.requests = self.requests, self.requests + 1
                if await self.answer(reader, writer, n) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def _plain(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


def _chunked(pieces: list[bytes]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    return out + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def run(coro):
    return asyncio.run(coro)


def test_answers_read_whole_and_streamed_over_one_kept_alive_connection():
    async def answer(reader, writer, n):
        if n % 2:
            writer.write(_chunked([b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]))
        else:
            writer.write(_plain(b'{"n": %d}' % n))
        await writer.drain()

    async def main():
        async with Engine(answer) as engine:
            pool = Upstream(engine.url, timeout=5)
            for n in range(6):
                response = await pool.post("/v1/chat/completions", BODY, stream=bool(n % 2))
                assert response.status_code == 200
                if n % 2:
                    pieces = [p async for p in response.iter_bytes()]
                    response.close()
                    assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
                else:
                    assert await response.read() == b'{"n": %d}' % n
            assert engine.connections == 1
            pool.close()

    run(main())


def test_an_idle_connection_the_engine_closed_is_replaced_without_an_error():
    async def answer(reader, writer, n):
        if n in (1, 3):  # the engine drops the kept-alive connection as the next request arrives
            return "close"
        writer.write(_plain(b"ok"))
        await writer.drain()
        return "close" if n == 4 else None

    async def main():
        async with Engine(answer) as engine:
            pool = Upstream(engine.url, timeout=5)
            for _ in range(3):
                response = await pool.post("/v1/completions", BODY, stream=False)
                assert await response.read() == b"ok"
            assert engine.requests == 5 and engine.connections == 3
            await asyncio.sleep(0.05)  # the last close reaches the idle connection: not used again
            assert await (await pool.post("/v1/completions", BODY, stream=False)).read() == b"ok"
            assert engine.connections == 4

    run(main())


def test_connection_close_is_honoured():
    async def answer(reader, writer, n):
        writer.write(_plain(b"ok", b"Connection: close\r\n"))
        await writer.drain()

    async def main():
        async with Engine(answer) as engine:
            pool = Upstream(engine.url, timeout=5)
            for _ in range(2):
                assert await (await pool.post("/v1/completions", BODY, stream=False)).read() == b"ok"
            assert engine.connections == 2

    run(main())


def test_an_engine_that_cannot_be_reached_is_an_upstream_error():
    async def main():
        async with Engine(None) as engine:
            url = engine.url
        with pytest.raises(UpstreamError, match="cannot connect"):
            await Upstream(url, timeout=5).post("/v1/completions", BODY, stream=False)

    run(main())


def test_an_engine_that_says_nothing_times_out():
    async def answer(reader, writer, n):
        await asyncio.sleep(30)

    async def main():
        async with Engine(answer) as engine:
            with pytest.raises(UpstreamError, match=r"sent nothing for 0.2 s"):
                await Upstream(engine.url, timeout=0.2).post("/v1/completions", BODY, stream=False)

    run(main())


def test_a_stream_the_engine_breaks_off_is_an_upstream_error_and_the_connection_is_not_reused():
    async def answer(reader, writer, n):
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
            await writer.drain()
            return "close"
        writer.write(_plain(b"fresh"))
        await writer.drain()

    async def main():
        async with Engine(answer) as engine:
            pool = Upstream(engine.url, timeout=5)
            response = await pool.post("/v1/chat/completions", BODY, stream=True)
            got = []
            with pytest.raises(UpstreamError, match="closed the connection"):
                async for piece in response.iter_bytes():
                    got.append(piece)
            response.close()
            assert got == [b"data: 1\n\n"]
            assert await (await pool.post("/v1/completions", BODY, stream=False)).read() == b"fresh"
            assert engine.connections == 2

    run(main())


def test_an_answer_that_is_not_http_is_an_upstream_error():
    async def answer(reader, writer, n):
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    async def main():
        async with Engine(answer) as engine:
            with pytest.raises(UpstreamError, match="not valid HTTP"):
                await Upstream(engine.url, timeout=5).post("/v1/completions", BODY, stream=False)

    run(main())


def test_abort_ends_a_reader_in_another_task_and_is_a_no_op_once_the_answer_is_done():
    release = asyncio.Event

    async def main():
        gate = release()

        async def answer(reader, writer, n):
            if n == 0:  # a stream that stalls after its first event
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
                await writer.drain()
                await gate.wait()
                return "close"
            writer.write(_plain(b"ok"))
            await writer.drain()

        async with Engine(answer) as engine:
            pool = Upstream(engine.url, timeout=5)
            response = await pool.post("/v1/chat/completions", BODY, stream=True)

            async def read():
                return [piece async for piece in response.iter_bytes()]

            reader = asyncio.ensure_future(read())
            await asyncio.sleep(0.1)
            response.abort()
            with pytest.raises(UpstreamError, match="hung up"):
                await reader
            gate.set()
            done = await pool.post("/v1/completions", BODY, stream=False)
            assert await done.read() == b"ok"
            done.abort()  # after the answer: the pooled connection is left alone
            again = await pool.post("/v1/completions", BODY, stream=False)
            assert await again.read() == b"ok"
            assert engine.connections == 2

    run(main())
