"""The gateway's app: a raw ASGI front for the calls (``_CallFront``: the hot path, no framework in it) in
each dialect (``capture/dialects``), before FastAPI for the rollout, reward, finish and OTLP routes and the
sweeps (``routes.py``); serving it (``serve``, ``BackgroundGateway``). What each route does: ``proxy.py``'s
doc."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from typing import Any

import orjson

from .. import semconv
from ..capture.dialects import DIALECTS, MESSAGES, RESPONSES, Dialect
from ..capture.dialects.chat import error as openai_error
from ..boundaries import message_problems
from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, GatewayError, TranslationError, UpstreamError
from ..serving import GATEWAY, BackgroundService, check_bind, run
from .coding_agents import claude_code_lineage, codex_lineage
from .forwarding import Relay
from .proxy import Gateway
from .rollouts import OpenRollout

try:
    from fastapi import FastAPI
except ImportError as exc:  # the gateway is an extra, like the store server
    raise ConfigurationError(
        f"the gateway needs FastAPI and uvicorn ({exc}); they come with lightning-rl: pip install fastapi uvicorn httptools (or reinstall lightning-rl)"
    ) from None
from .routes import add_routes, lifespan
from .routes import parse_body as _parse_body

AGENT_HEADER = "x-lightning-rl-agent"


def create_app(gateway: Gateway) -> Any:
    """The ASGI app serving ``gateway``: the calls' front (``_CallFront``) before the FastAPI app of its own
    routes (``routes.py``)."""
    app = FastAPI(title="lightning-rl gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    add_routes(app)
    return _CallFront(gateway, app)


def _check_messages(messages: Any) -> None:
    """Chat messages the assembly can read back, or 400 before anything is forwarded or recorded."""
    problems = message_problems(messages)
    if problems:
        raise GatewayError(400, f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                           problems)


# A call's path: under /v1 (rollout by key), a rollout's base URL, or an agent's.
_CALL_PATH = re.compile(r"(?:/rollouts/(?P<rollout>[^/]+)(?:/agents/(?P<agent>[^/]+))?)?"
                        r"/v1/(?P<endpoint>chat/completions|completions|messages|responses)")
_DOUBLED_V1 = re.compile(r"(?:/rollouts/[^/]+(?:/agents/[^/]+)?)?/v1/v1/(?P<endpoint>chat/completions|completions|"
                         r"messages|responses)")
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class _CallFront:
    """The gateway's ASGI app: the LLM calls (the hot path, every call an agent makes) answered here
    directly, everything else by the FastAPI app behind. Routing a call through FastAPI's middleware,
    request objects and streaming response cost a sixth of the gateway's CPU per call
    (docs/benchmarks.md section 12); these routes need none of it."""

    def __init__(self, gateway: Gateway, app: Any) -> None:
        self.gateway, self.app = gateway, app
        self.dialects = DIALECTS  # the protocols answered through chat completions

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _CALL_PATH.fullmatch(scope["path"])
            if match is not None:
                await self._call(scope, receive, send, *match.group("rollout", "agent", "endpoint"))
                return
            doubled = _DOUBLED_V1.fullmatch(scope["path"])
            if doubled is not None:  # ANTHROPIC_BASE_URL set to a base URL ending in /v1: its client adds another
                count("gateway_doubled_v1_paths")
                message = (f"{scope['path']} has /v1 twice: this client adds /v1 itself, so give it the rollout's "
                           "base URL without its /v1 (e.g. ANTHROPIC_BASE_URL=http://HOST:PORT/rollouts/ID)")
                dialect = self.dialects.get(doubled.group("endpoint"), None)
                body = orjson.dumps(dialect.error(404, message) if dialect else openai_error(404, message))
                await send({"type": "http.response.start", "status": 404,
                            "headers": [_JSON, (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    async def _call(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any],
                    rollout_id: str | None, agent: str | None, endpoint: str) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        dialect = self.dialects.get(endpoint, None)
        try:
            if self.gateway.shared:  # the rollout as the store has it now: a read, off the event loop
                active = await asyncio.to_thread(self.gateway.rollout_for, rollout_id, headers)
            else:  # credentials before the body is read
                active = self.gateway.rollout_for(rollout_id, headers)
            raw = await self._read(receive, headers)
            if dialect is None:
                answer = self._chat(headers, raw, active, agent, endpoint)
            else:
                answer = self._translated(headers, raw, active, agent, dialect)
            result = await _unless_hung_up(answer, receive)
            if result is _HUNG_UP:
                return
        except GatewayError as exc:
            shape = dialect.error(exc.status, exc.error) if dialect else openai_error(exc.status, exc.error, exc.details)
            result = exc.status, shape
        except Exception as exc:  # a defect of ours: the agent gets a 500 that says so, the failure is logged
            report_failure("gateway call", exc)
            result = 500, openai_error(500, f"the gateway failed on this call: {type(exc).__name__}: {exc}")
        if isinstance(result, Relay):
            await self._stream(result, receive, send)
            return
        status, data = result
        body = orjson.dumps(data)
        await send({"type": "http.response.start", "status": status,
                    "headers": [_JSON, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _read(self, receive: Callable[..., Any], headers: dict[str, str]) -> bytes:
        limit = self.gateway.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise GatewayError(400, "the client hung up before sending its whole request")
            piece = message.get("body", b"")
            size += len(piece)
            if size > limit:
                raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
            parts.append(piece)
            if not message.get("more_body"):
                return b"".join(parts)

    async def _stream(self, relay: Relay, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        """Send a stream as it comes; a client that hangs up cuts the engine's answer (recorded as cut)."""
        hung_up = False

        async def listen() -> None:
            nonlocal hung_up
            while (await receive())["type"] != "http.disconnect":
                pass
            hung_up = True
            relay.abort()

        listener = asyncio.ensure_future(listen())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
            async for piece in relay:
                if hung_up:
                    break
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except UpstreamError:
            if not hung_up:  # the engine broke off: the client's stream breaks off too
                raise
        finally:
            listener.cancel()
            await relay.aclose()

    async def _chat(self, headers: dict[str, str], raw: bytes, active: OpenRollout, agent: str | None,
                    path: str) -> Any:
        body = _parse_body(raw, self.gateway.max_body_bytes)
        if not isinstance(body.get("model"), str):
            raise GatewayError(422, f"model must be the served model's name (a string), got {body.get('model')!r}")
        if path == "chat/completions":
            _check_messages(body.get("messages"))
        notes = _served_as(active, body, self.gateway.model)
        return await self.gateway.forward(active, path, body, agent or headers.get(AGENT_HEADER), attributes=notes)

    async def _translated(self, headers: dict[str, str], raw: bytes, active: OpenRollout, agent: str | None,
                          dialect: Dialect) -> Any:
        """Anthropic Messages or OpenAI Responses, through chat completions; errors in the dialect's shape."""
        body = _parse_body(raw, self.gateway.max_body_bytes)
        if not isinstance(body.get("model"), str):
            raise GatewayError(400, f"model must be the served model's name (a string), got {body.get('model')!r}")
        try:
            chat = dialect.to_chat(body)
        except TranslationError as exc:  # said to the agent, and kept on its rollout (an event of its root span)
            count("gateway_requests_untranslatable")
            with contextlib.suppress(Exception):
                active.span.add_event("request refused", {"dialect": dialect.name, "error": str(exc)[:2000]})
            raise GatewayError(400, str(exc)) from None
        _check_messages(chat.get("messages"))
        chat["model"] = body["model"]
        notes = _served_as(active, chat, self.gateway.model)
        named = agent or headers.get(AGENT_HEADER)
        if dialect is MESSAGES:  # Claude Code's sub-agents and compactions (coding_agents.py)
            lineage, more = claude_code_lineage(headers, body)
            named, notes = named or lineage, {**notes, **more}
        elif dialect is RESPONSES:  # Codex's sub-agents and compactions (coding_agents.py)
            lineage, more = codex_lineage(headers, body)
            named, notes = named or lineage, {**notes, **more}
        stream = bool(chat.get("stream"))
        if stream:
            chat["stream_options"] = {"include_usage": True}  # the usage the final events carry
        result = await self.gateway.forward(active, "chat/completions", chat, named,
                                            render=dialect.stream(body) if stream else None, attributes=notes)
        if isinstance(result, Relay):
            return result
        status, data = result
        if status != 200:
            detail = data.get("error", data) if isinstance(data, dict) else data
            message = detail.get("message") if isinstance(detail, dict) else str(detail)
            return status, dialect.error(status, f"the engine answered {status}: {message}")
        return 200, dialect.from_chat(data, body)


_HUNG_UP = object()


async def _unless_hung_up(answer: Any, receive: Callable[..., Any]) -> Any:
    """``answer`` (a call waiting for the engine), or ``_HUNG_UP`` when the client hangs up first: the wait
    is cancelled, so the engine's request is closed (it stops) and the call is recorded as cut, not
    answered to nobody later (an agent killed at its timeout: ``lrl.command``). A stream's own wait for a
    hang-up starts once it is answered (``_stream``)."""
    work = asyncio.ensure_future(answer)

    async def hung_up() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    count("gateway_calls_cut_by_client")
    with contextlib.suppress(BaseException):
        await work
    return _HUNG_UP


def _served_as(active: OpenRollout, body: dict[str, Any], gateway_model: str | None) -> dict[str, Any]:
    """A rollout with a model of its own (``lrl.command``), else the gateway's (``--model``): the call goes
    to the engine as it, whatever name was asked (in place in ``body``); the name asked, when another, is
    kept on the call."""
    model = active.model or gateway_model
    if model is None or body.get("model") == model:
        return {}
    asked, body["model"] = body.get("model"), model
    return {semconv.ASKED_MODEL: str(asked)}


class BackgroundGateway(BackgroundService):
    """The gateway on a thread of this process (tests, notebooks). Port 0 picks a free port."""

    def __init__(self, upstreams: list[str], *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 **options: Any) -> None:
        check_bind(GATEWAY, host, token)  # before the gateway is built
        self.gateway = Gateway(upstreams, token=token, **options)
        super().__init__(GATEWAY, create_app(self.gateway), host=host, port=port, token=token)


def serve(gateway: Gateway, *, host: str = "127.0.0.1", port: int = 8400, log_level: str = "warning",
          announce: Callable[[], None] | None = None) -> None:
    """Run the gateway until interrupted (its open rollouts live in its memory, or with ``shared`` in the store)."""
    run(GATEWAY, create_app(gateway), host=host, port=port, token=gateway.token, log_level=log_level,
        announce=announce, timeout_graceful_shutdown=10)


__all__ = ["AGENT_HEADER", "BackgroundGateway", "create_app", "serve"]
