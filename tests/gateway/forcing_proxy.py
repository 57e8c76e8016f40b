"""A forwarding proxy for tests, between the gateway and the real vLLM server, that makes the tiny model
call a tool whatever its weights say, by vLLM's guided decoding, so that a real CLI runs the tool, and call
no other: nothing a CLI offers is left to what the sampled model writes (a free ``tool_choice="required"``
once let the tiny model call opencode's ``skill`` tool with arguments ``": "`` until opencode's doom-loop
guard refused it and the run failed). On the first chat-completions request that offers tools:

- ``call=(name, arguments)``: that request may only be answered with this exact call (a regex of the
  call as the model's template, hermes, writes one; vLLM's tool parser reads it as a tool call): a tool
  and arguments the test knows the CLI can run;
- ``choice``: else its ``tool_choice`` is set to this (``None``: the request's own is kept, e.g. a named one,
  which vLLM's guided decoding already makes a call of that tool);
- ``logit_bias``: added to that request too (``conftest.no_free_whitespace``: a constrained call cannot be
  padded with spaces until ``max_tokens`` and left unclosed);
- ``after``: every later request that offers tools is sent with this ``tool_choice`` (default ``"none"``: the
  model may call no tool at all after the forced one, so that no tool the CLI offers is left to what the
  sampled model writes, and the CLI's turn ends on a text answer; ``None``: as the CLI sent it);
- ``stall=True``: nothing is forced, and a request that offers tools gets no answer until its client
  hangs up (an engine that hangs: the CLI waits on it).

Every other request, and every answer (streams too), passes through byte for byte. ``forced``: the
bodies it forced a call in, as sent; ``requests``: every chat-completions body, as sent."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import httpx
import orjson

from lightning_rl.serving import ServerThread

_HOP = {b"connection", b"content-length", b"transfer-encoding", b"keep-alive", b"host"}


class ForcingProxy:
    """``with ForcingProxy(ENGINE_URL) as proxy:`` give ``proxy.url + "/v1"`` as the upstream."""

    def __init__(self, engine: str, choice: Any = None, call: tuple[str, dict[str, Any]] | None = None,
                 stall: bool = False, logit_bias: dict[str, int] | None = None, after: str | None = "none") -> None:
        self.engine, self.choice, self.call, self.stall = engine.rstrip("/").removesuffix("/v1"), choice, call, stall
        self.logit_bias, self.after = logit_bias, after
        self.forced: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self._closing = False

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # a function: uvicorn's ASGI 3
            await self.handle(scope, receive, send)

        self._thread = ServerThread(app, name="forcing-proxy")
        self.url = self._thread.url

    def __enter__(self) -> ForcingProxy:
        self._thread.start("forcing proxy")
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self._thread.stop()

    def _force(self, body: dict[str, Any]) -> None:
        if self.logit_bias:
            body["logit_bias"] = {**body.get("logit_bias", {}), **self.logit_bias}
        if self.call is None:
            if self.choice is not None:
                body["tool_choice"] = self.choice
        else:
            text = orjson.dumps({"name": self.call[0], "arguments": self.call[1]}).decode()
            body["structured_outputs"] = {"regex": re.escape(f"<tool_call>{text}</tool_call>")}
            body["max_tokens"] = len(text) + 64
        self.forced.append(body)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/chat/completions":
            body = orjson.loads(raw)
            self.requests.append(body)
            if body.get("tools") and self.stall:  # until the client hangs up or the proxy closes
                while not self._closing:
                    with contextlib.suppress(TimeoutError):
                        if (await asyncio.wait_for(receive(), 0.2))["type"] == "http.disconnect":
                            return
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            if body.get("tools") and not self.forced:
                self._force(body)
                raw = orjson.dumps(body)
            elif body.get("tools") and self.after is not None:
                body["tool_choice"] = self.after
                raw = orjson.dumps(body)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        url = self.engine + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client, \
                client.stream(scope["method"], url, content=raw, headers=headers) as answer:
            await send({"type": "http.response.start", "status": answer.status_code,
                        "headers": [(k, v) for k, v in answer.headers.raw if k.lower() not in _HOP]})
            async for piece in answer.aiter_raw():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
