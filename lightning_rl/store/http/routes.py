"""The store server's routes for policies and decisions, and for the task queue (``http/server.py`` builds the
app; these map one to one onto the store's ``PolicyLog`` and ``TaskQueue`` methods), with the response
and OpenAPI helpers every route uses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from fastapi import Request
from fastapi.responses import Response

from ...diagnostics import count
from ...records import PolicyDecision, PolicyRecord, QueueEntry
from .. import wire
from ..protocols import Store
from .auth import queue_listing_refused

#: how many waiting lease requests one server holds at once (each a blocked thread; more queue for a thread)
LEASE_WAITERS = 512
#: the request bodies of routes that parse their raw body themselves, for the OpenAPI document
BODY_DEFS: dict[str, Any] = {}
BodyOf = Callable[[Request, type], Awaitable[Any]]


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def policy_json(record: PolicyRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


def body_schema(model: type) -> dict:
    """The request body of a route that parses its raw body itself (fast path), for the OpenAPI document.
    Nested models are hoisted into ``components/schemas`` by ``server._openapi_with_bodies``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    BODY_DEFS.update(schema.pop("$defs", {}))
    BODY_DEFS[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_policy_routes(app: Any, store: Store, p: str, body_of: BodyOf) -> None:
    """Publishes and the decisions about them."""

    @app.post(f"{p}/policies", response_model=PolicyRecord, openapi_extra=body_schema(wire.PolicyIn))
    async def record_policy(request: Request) -> Response:
        """Record a publish (durable on return); every process stamps its LLM calls from these."""
        data = await body_of(request, wire.PolicyIn)
        record = await anyio.to_thread.run_sync(lambda: store.record_policy(
            data.served_name, data.version, adapter=data.adapter, time=data.time, trained_on=data.trained_on,
            served_as=data.served_as))
        return json_response(policy_json(record))

    @app.post(f"{p}/decisions", response_model=PolicyDecision, openapi_extra=body_schema(wire.DecisionIn))
    async def record_decision(request: Request) -> Response:
        """Record a decision about a served name's policy (the gate's, a rollback), durable on return."""
        data = await body_of(request, wire.DecisionIn)
        record = await anyio.to_thread.run_sync(lambda: store.record_decision(
            data.served_name, data.version, data.decision, live_version=data.live_version, adapter=data.adapter,
            figures=data.figures, reason=data.reason, time=data.time))
        return json_response(record.model_dump(mode="json"))

    @app.get(f"{p}/decisions", response_model=list[PolicyDecision])
    async def decisions(served_name: str | None = None, latest: bool = False) -> Response:
        """Recorded decisions, oldest first (of ``served_name``, or all); ``latest``: the last one about each
        served name (a canary in progress, ``continuous.py``)."""
        def read() -> list[PolicyDecision]:
            if latest:
                return [d for d in store.latest_decisions().values() if served_name in (None, d.served_name)]
            return store.decisions(served_name)

        found = await anyio.to_thread.run_sync(read)
        return json_response([r.model_dump(mode="json") for r in found])

    @app.get(f"{p}/policies", response_model=list[PolicyRecord])
    async def policies(served_name: str | None = None, latest: bool = False) -> Response:
        """Recorded publishes, oldest first; ``latest``: the last one of each served name."""
        def read() -> list[PolicyRecord]:
            if latest:
                return [p for p in store.latest_policies().values() if served_name is None or p.served_name == served_name]
            return store.policies(served_name)

        found = await anyio.to_thread.run_sync(read)
        return json_response([policy_json(r) for r in found])


def add_queue_routes(app: Any, store: Store, p: str, body_of: BodyOf) -> None:
    """The task queue: enqueue, lease, heartbeat, complete, entries."""

    @app.post(f"{p}/queue/enqueue", response_model=list[QueueEntry], openapi_extra=body_schema(wire.EnqueueIn))
    async def enqueue(request: Request) -> Response:
        data = await body_of(request, wire.EnqueueIn)
        entries = await anyio.to_thread.run_sync(lambda: store.enqueue(
            data.task, n=data.n, mode=data.mode, max_tries=data.max_tries, group_id=data.group_id, once=data.once,
            overrides=data.overrides))
        return json_response([wire.queue_entry_json(e) for e in entries])

    waiting: list[anyio.CapacityLimiter] = []  # made on the first waiting lease (it needs the running loop)

    @app.post(f"{p}/queue/lease", response_model=list[QueueEntry], openapi_extra=body_schema(wire.LeaseIn))
    async def lease(request: Request) -> Response:
        """Lease tries; ``wait``: a long poll, held at most ``wire.MAX_LEASE_WAIT`` seconds, on threads of its
        own (a server full of idle runners' waits still answers every other request at once)."""
        data = await body_of(request, wire.LeaseIn)
        count("store_server_lease_requests")  # the requests idle runners send (``GET /v1/stats``)
        wait = min(data.wait, wire.MAX_LEASE_WAIT)
        if wait and not waiting:
            waiting.append(anyio.CapacityLimiter(LEASE_WAITERS))
        entries = await anyio.to_thread.run_sync(lambda: store.lease(
            data.runner, lease_seconds=data.lease_seconds, limit=data.limit, key=data.key, wait=wait),
            limiter=waiting[0] if wait else None)
        return json_response([wire.queue_entry_json(e) for e in entries])

    @app.post(f"{p}/queue/heartbeat", response_model=wire.Ok, openapi_extra=body_schema(wire.HeartbeatIn))
    async def heartbeat(request: Request) -> Response:
        data = await body_of(request, wire.HeartbeatIn)
        ok = await anyio.to_thread.run_sync(lambda: store.heartbeat(
            data.queue_id, data.runner, lease_seconds=data.lease_seconds))
        return json_response({"ok": ok})

    @app.post(f"{p}/queue/complete", response_model=wire.Ok, openapi_extra=body_schema(wire.CompleteIn))
    async def complete(request: Request) -> Response:
        data = await body_of(request, wire.CompleteIn)
        ok = await anyio.to_thread.run_sync(lambda: store.complete(data.queue_id, data.runner, data.outcome))
        return json_response({"ok": ok})

    @app.post(f"{p}/queue/entries", response_model=list[QueueEntry], openapi_extra=body_schema(wire.GroupsIn))
    async def queue_entries(request: Request) -> Response:
        data = await body_of(request, wire.GroupsIn)
        refused = queue_listing_refused(request.scope, data.group_ids)  # a runner names its groups
        if refused is not None:
            count("store_server_forbidden")
            return json_response({"error": refused, "details": []}, 403)
        entries = await anyio.to_thread.run_sync(lambda: store.queue_entries(data.group_ids))
        return json_response([wire.queue_entry_json(e) for e in entries])
