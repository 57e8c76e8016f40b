"""The gateway's own routes (``app.py`` assembles them behind the calls' front): health, the engines it routes
to, opening a rollout, its rewards and finish, OTLP span exports; the sweeps of orphaned and idle rollouts
that run while it serves. The :class:`~.proxy.Gateway` they serve is ``app.state.gateway``. What each route
does: ``proxy.py``'s doc."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from ..boundaries import json_problem
from ..capture.dialects.chat import error as openai_error
from ..diagnostics import report_failure
from ..errors import GatewayError, OTLPDecodeError, OTLPTooLarge
from . import otlp
from .proxy import Gateway


def add_routes(app: Any) -> None:
    """The routes, on ``app`` (whose ``state.gateway`` is the :class:`Gateway` they serve; its lifespan is
    :func:`lifespan`)."""
    app.add_exception_handler(GatewayError, refused)
    app.get("/openapi.json", include_in_schema=False)(openapi)
    app.get("/v1/health")(health)
    app.get("/v1/upstreams")(upstreams)
    app.post("/v1/rollouts")(open_rollout)
    app.post("/v1/rollouts/{rollout_id}/rewards")(reward)
    app.post("/v1/rollouts/{rollout_id}/finish")(finish)
    app.post("/v1/traces")(traces)
    app.post("/rollouts/{rollout_id}/v1/traces")(rollout_traces)


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


async def sweep(gateway: Gateway) -> None:
    """Expire orphaned rollouts (at start: those a gateway killed before this one left running), then idle
    ones, every ``idle_timeout / 4`` seconds (at most a minute)."""
    every = min(60.0, gateway.idle_timeout / 4)
    while True:
        for what, fn in (("orphan", gateway.expire_orphans), ("idle", gateway.expire_idle)):
            try:  # the orphans first at start: what a gateway killed before this one left running
                await asyncio.to_thread(fn)
            except RuntimeError as exc:
                if "after shutdown" in str(exc):  # the interpreter is exiting (a gateway on a daemon thread)
                    return
                report_failure(f"gateway {what} sweep", exc)
            except Exception as exc:
                report_failure(f"gateway {what} sweep", exc)
            if what == "orphan":
                await asyncio.sleep(every)


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """The sweeps while the gateway serves; on the way out, its open rollouts ended and its clients closed."""
    gateway: Gateway = app.state.gateway
    sweeper = asyncio.ensure_future(sweep(gateway)) if gateway.idle_timeout is not None else None
    try:
        yield
    finally:
        if sweeper is not None:
            sweeper.cancel()
        try:  # on this thread: at interpreter exit (a local gateway) no worker thread can be started
            gateway.end_all("the gateway stopped before the rollout was finished (its key died with it); the "
                            "calls so far are recorded")
        except Exception as exc:  # the store may be gone already; the records so far stay as they are
            report_failure("gateway stop", exc)
        await gateway.close()


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def raw_body(request: Request) -> bytes:
    """The body, read up to the limit (413 beyond it, also when it comes chunked)."""
    limit = gateway_of(request).max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
    parts, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
        parts.append(piece)
    return b"".join(parts)


def parse_body(raw: bytes, limit: int, invalid: int = 400) -> dict[str, Any]:
    """A JSON object body; ``invalid``: the status for a value that cannot be recorded (the LLM routes
    answer 400 as OpenAI's API does; the gateway's own routes 422)."""
    if len(raw) > limit:
        raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, "the request body is not valid JSON", [str(exc)]) from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    problem = json_problem(body, "body")
    if problem:
        raise GatewayError(invalid, f"the request body cannot be recorded: {problem}")
    return body


async def _body(request: Request) -> dict[str, Any]:
    return parse_body(await raw_body(request), gateway_of(request).max_body_bytes, invalid=422)


async def refused(request: Request, exc: GatewayError) -> Response:
    # OpenAI's error shape, so that an agent's OpenAI client shows the reason
    return json_response(openai_error(exc.status, exc.error, exc.details), exc.status)


async def openapi(request: Request) -> Response:
    gateway_of(request).check_admin(request.headers)  # like every route but health
    return json_response(request.app.openapi())


async def health(request: Request) -> Response:
    gateway = gateway_of(request)
    return json_response({"ok": True, "open_rollouts": len(gateway.rollouts), "upstreams": gateway.upstream_health()})


async def upstreams(request: Request) -> Response:
    """The engines this gateway routes to (the replicas a publish must reach), with the gateway's token."""
    gateway = gateway_of(request)
    gateway.check_admin(request.headers)
    return json_response({"upstreams": gateway.upstream_urls()})


async def open_rollout(request: Request) -> Response:
    gateway = gateway_of(request)
    gateway.check_admin(request.headers)
    body = await _body(request)
    return json_response(await asyncio.to_thread(gateway.open_rollout, body, str(request.base_url)))


async def reward(rollout_id: str, request: Request) -> Response:
    gateway = gateway_of(request)
    gateway.check_rollout_credentials(rollout_id, request.headers)
    body = await _body(request)
    return json_response(await asyncio.to_thread(gateway.reward, rollout_id, body, request.headers))


async def finish(rollout_id: str, request: Request) -> Response:
    gateway = gateway_of(request)
    gateway.check_rollout_credentials(rollout_id, request.headers)
    body = await _body(request)
    return json_response(await asyncio.to_thread(gateway.finish, rollout_id, body, request.headers))


async def _traces(request: Request, rollout_id: str | None) -> Response:
    gateway = gateway_of(request)
    if gateway.shared:  # before a byte of the body is read or inflated (shared: a store read, off the loop)
        await asyncio.to_thread(gateway.check_spans_sender, rollout_id, request.headers)
    else:
        gateway.check_spans_sender(rollout_id, request.headers)
    body = await raw_body(request)
    kind = otlp.content_kind(request.headers.get("content-type"))
    try:
        spans = otlp.decode(body, kind, request.headers.get("content-encoding"), gateway.max_body_bytes)
    except OTLPTooLarge as exc:
        raise GatewayError(413, str(exc)) from None
    except OTLPDecodeError as exc:
        raise GatewayError(400, str(exc)) from None
    problems = otlp.span_problems(spans)
    if problems:
        raise GatewayError(400, f"{len(problems)} span value(s) cannot be stored; nothing of this export was "
                                f"stored: {problems[0]}", problems)
    taken = await asyncio.to_thread(gateway.take_spans, spans, rollout_id, request.headers)
    return Response(otlp.encode_answer(taken["rejected"], taken["message"], kind),
                    media_type="application/x-protobuf" if kind == "protobuf" else "application/json")


async def traces(request: Request) -> Response:
    return await _traces(request, None)


async def rollout_traces(rollout_id: str, request: Request) -> Response:
    return await _traces(request, rollout_id)
