"""The gateway's calls: each goes to an engine (a rollout sticks to its own; a new one goes to the least
busy of those up), is captured by the capture core (``capture/exchange.py``) and answered whole or as a
stream relayed as it comes (``Relay``). Tool messages in a conversation become tool spans."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import orjson

from ..errors import EngineRefusal, GatewayError, UpstreamError
from .. import semconv
from ..capture import CapturedCall, Server, gc_paused, refused_token_fields, resend_without_token_fields
from ..capture.dialects.chat import ChatRenderer, relay_line, strip
from ..diagnostics import count
from ..tracer.context import rollout_scope
from ..tracer.provider import current_span_of_ours, record_tool_span
from .rollouts import OpenRollout
from .shared import new_tool_messages
from .upstream import Response as UpstreamResponse
from .upstream import Upstream

ENDPOINTS = {"chat/completions": semconv.OP_CHAT, "completions": semconv.OP_TEXT_COMPLETION}


class Forwarding:
    """Calls to the engines (a part of :class:`~lightning_rl.gateway.proxy.Gateway`, over its state)."""

    upstreams: list[str]
    shared: bool
    down_for: float
    timeout: float
    _in_flight: dict[str, int]
    _down_until: dict[str, float]
    _pools: dict[str, Upstream]
    _servers: dict[str, Server]

    def _pick(self, active: OpenRollout) -> list[str]:
        """Upstreams to try, in order: the rollout's own first, then the least busy of those up."""
        now = time.monotonic()
        up = [u for u in self.upstreams if self._down_until[u] <= now]
        ranked = sorted(up, key=lambda u: self._in_flight[u])
        if active.upstream in up:
            ranked.remove(active.upstream)
            ranked.insert(0, active.upstream)
        return ranked or list(self.upstreams)  # all marked down: try them anyway

    @contextlib.contextmanager
    def _in_rollout(self, active: OpenRollout, agent: str | None) -> Iterator[None]:
        with rollout_scope(active.state, agent), current_span_of_ours(active.span):
            yield

    def _tool_spans(self, active: OpenRollout, body: dict[str, Any]) -> None:
        """A tool message answering one of the assistant's tool calls: a tool span, once per call id."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return
        if self.shared:  # answered before the last assistant message: an earlier call, maybe elsewhere, saw them
            active.tool_calls_seen |= new_tool_messages(messages)
        asked: dict[str, dict[str, Any]] = {}
        for message in messages:
            if not isinstance(message, dict):
                continue
            for tc in message.get("tool_calls") or ():
                if isinstance(tc, dict) and isinstance(tc.get("id"), str) and isinstance(tc.get("function"), dict):
                    asked[tc["id"]] = tc["function"]
            call_id = message.get("tool_call_id")
            if message.get("role") == "tool" and isinstance(call_id, str) and call_id \
                    and call_id not in active.tool_calls_seen:
                active.tool_calls_seen.add(call_id)
                fn = asked.get(call_id, {})
                with record_tool_span(fn.get("name") or message.get("name") or "tool", call_id,
                                      fn.get("arguments"), SimpleNamespace(result=message.get("content"))):
                    pass

    def start_call(self, active: OpenRollout, op: str, body: dict[str, Any], agent: str | None,
                   upstream: str, attributes: dict[str, Any] | None = None) -> CapturedCall:
        with self._in_rollout(active, agent):
            if op == semconv.OP_CHAT:
                self._tool_spans(active, body)
            call = CapturedCall(self._servers[upstream], body, op, active.state, json=True)
        if attributes:  # what the call front knows of it (the model name asked for, a CLI's lineage)
            call.span.set_attributes(attributes)
        return call

    async def forward(self, active: OpenRollout, path: str, body: dict[str, Any], agent: str | None,
                      render: Any = None, attributes: dict[str, Any] | None = None) -> Any:
        """Send one call to an engine and record it; returns (status, JSON) or a ``Relay`` of SSE bytes
        (the engine's chunks as ``render`` writes them: by default as the engine sent them); ``attributes``
        go on the call's span."""
        op = ENDPOINTS[path]
        errors: list[str] = []
        for upstream in self._pick(active):
            call = self.start_call(active, op, body, agent, upstream, attributes)
            try:
                result = await self._send(call, upstream, path, body, render or ChatRenderer())
            except asyncio.CancelledError:  # the agent hung up while the engine worked: recorded as cut
                call.finish(incomplete=True, error=ConnectionAbortedError("the agent hung up before the engine "
                                                                          "answered"))
                raise
            except UpstreamError as exc:
                self._down_until[upstream] = time.monotonic() + self.down_for
                errors.append(f"{upstream}: {exc}")
                call.finish(error=ConnectionError(f"{upstream} could not be reached: {exc}"))
                count("gateway_upstream_unreachable")
                continue
            active.upstream = upstream
            if self.shared and not isinstance(result, Relay):  # stored before answered (a stream: at its end)
                await asyncio.to_thread(self._settle)
            return result
        if self.shared:
            await asyncio.to_thread(self._settle)
        raise GatewayError(502, "no upstream engine could serve this call (tried them all); it is recorded on the "
                                "rollout as a failed call", errors)

    def upstream_health(self) -> dict[str, dict[str, Any]]:
        """Each upstream: whether it is up (not marked down) and its calls in flight (``/v1/health``)."""
        now = time.monotonic()
        return {u: {"up": self._down_until[u] <= now, "in_flight": self._in_flight[u]} for u in self.upstreams}

    def _pool(self, upstream: str) -> Upstream:
        pool = self._pools.get(upstream)
        if pool is None:
            pool = self._pools[upstream] = Upstream(upstream, timeout=self.timeout)
        return pool

    async def _send(self, call: CapturedCall, upstream: str, path: str, body: dict[str, Any], render: Any) -> Any:
        stream = bool(body.get("stream"))
        pool = self._pool(upstream)
        while True:
            sent = orjson.dumps({**body, **call.extra} if call.extra else body)
            self._in_flight[upstream] += 1
            try:
                response = await pool.post(f"/v1/{path}", sent, stream=stream)
                if response.status_code != 200 or not stream:
                    raw = await response.read()
            except BaseException:
                self._in_flight[upstream] -= 1
                raise
            if response.status_code != 200:
                self._in_flight[upstream] -= 1
                text = raw.decode(errors="replace")
                refused = EngineRefusal(response.status_code, text)
                if resend_without_token_fields(call, refused):
                    refused_token_fields(call)
                    continue
                call.finish(error=refused)
                return response.status_code, _error_json(text)
            if not stream:
                self._in_flight[upstream] -= 1
                with gc_paused():  # a whole answer's thousands of dicts set off no collection (capture/exchange.py)
                    data = orjson.loads(raw)
                    call.record_response(data)
                    return 200, strip(data, call.injected)
            call.streamed = True
            return Relay(self._relay(call, response, upstream, render), response)

    async def _relay(self, call: CapturedCall, response: UpstreamResponse, upstream: str, render: Any) -> AsyncIterator[bytes]:
        """The engine's SSE lines, read as they arrive and recorded; what one network read brings is
        written to the client in one piece (one send per read, not per line)."""
        finished = False
        pending = b""
        try:
            async for received in response.iter_bytes():
                *lines, pending = (pending + received).split(b"\n")
                out = []
                for raw in lines:
                    piece, end = relay_line(raw, call, render)
                    if end and not finished and self.shared:  # stored before the agent reads the end
                        call.finish()
                        await asyncio.to_thread(self._settle)
                    finished = finished or end
                    if piece:
                        out.append(piece)
                if out:
                    yield b"".join(out)
        finally:
            response.close()
            self._in_flight[upstream] -= 1
            call.finish(incomplete=not finished)

    async def close(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()



class Relay:
    """A streamed answer: the SSE bytes to send (``async for``), and ``abort`` for a client that hung up
    (closes the engine's connection, so the engine stops and the call is recorded as cut)."""

    def __init__(self, chunks: AsyncIterator[bytes], response: UpstreamResponse) -> None:
        self.chunks, self._response = chunks, response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks

    def abort(self) -> None:
        self._response.abort()

    async def aclose(self) -> None:
        await self.chunks.aclose()


def _error_json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return {"error": {"message": text[:2000]}}


