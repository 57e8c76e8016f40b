"""The store server's routes (``http/server.py`` assembles the app, behind the guard that checks tokens, roles
and body sizes): one method of :class:`StoreRoutes` per route, each mapping one to one onto a ``Store`` method;
the answers of refused requests (:func:`problem`, one per error the routes raise); the response and OpenAPI
helpers every route uses.

Bodies are parsed from their raw bytes by the wire models (strict, no FastAPI validation on the fast path), so
a route names its body model for the OpenAPI document itself (:func:`body_schema`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Annotated, Any

import anyio
import orjson
from fastapi import Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ...boundaries import INT64_MAX
from ...diagnostics import count, counters
from ...errors import LightningRLError, RolloutNotFoundError, StoreError
from ...records import (PolicyDecision, PolicyRecord, QuarantinedRecord, QueueEntry, Reward, Rollout, RolloutPage,
                        RolloutQuery, Span)
from .. import wire
from ..protocols import Store
from ..queries import trajectory as assemble_trajectory
from .auth import queue_listing_refused

#: how many waiting lease requests one server holds at once (each a blocked thread; more queue for a thread)
LEASE_WAITERS = 512
#: how many rollout ids a server remembers as existing (to check a batch's references without a query)
KNOWN_CACHE = 200_000
#: the request bodies of routes that parse their raw body themselves, for the OpenAPI document
BODY_DEFS: dict[str, Any] = {}
#: An integer query parameter: a count, a position or a version, stored or compared in SQLite.
QueryInt = Annotated[int, Query(ge=0, le=INT64_MAX)]
_OP_TAGS = ("start_rollout", "span", "reward", "finish_rollout")


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


# -- refused requests: ``{"error": ..., "details": [...]}`` with the status of each cause


def problem(status: int, error: str, details: list[str] | None = None,
            invalid_ops: list[int] | None = None) -> Response:
    body: dict[str, Any] = {"error": error, "details": details or []}
    if invalid_ops is not None:  # a refused batch: which ops to set aside (the client sends the rest again)
        body["invalid_ops"] = invalid_ops
    return json_response(body, status)


class _Refused(Exception):
    """A request a route refuses, with its answer (:func:`problem`)."""

    def __init__(self, status: int, error: str, details: list[str] | None = None,
                 invalid_ops: list[int] | None = None) -> None:
        super().__init__(error)
        self.response = problem(status, error, details, invalid_ops)


def validation_details(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors(include_url=False)[:50]:
        loc = list(err["loc"])
        if len(loc) >= 3 and loc[0] == "ops" and isinstance(loc[1], int) and loc[2] in _OP_TAGS:
            # pydantic puts the union's tag in the path: ops.1.span.span.seq -> ops[1] (span op): span.seq
            where = f"ops[{loc[1]}] ({loc[2]} op): " + ".".join(str(p) for p in loc[3:])
        else:
            where = ".".join(str(p) for p in loc) or "body"
        out.append(f"{where}: {err['msg']}")
    return out


def parse(model: type[BaseModel], body: bytes) -> Any:
    """``body`` as ``model`` (strict), else :class:`_Refused`: 400 for JSON that does not parse, 422 for a value
    the schema refuses (a batch's answer names its invalid ops)."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise _Refused(400, "the request body is not valid JSON",
                           [e["msg"] for e in exc.errors(include_url=False)[:5]]) from None
        details = validation_details(exc)
        raise _Refused(422, "the request body does not match the schema (see /openapi.json)", details,
                       wire.op_indices(details) if model is wire.Batch else None) from None


async def body_of(request: Request, model: type[BaseModel]) -> Any:
    return parse(model, await request.body())


async def _refused(request: Request, exc: _Refused) -> Response:
    return exc.response


async def _not_found(request: Request, exc: RolloutNotFoundError) -> Response:
    return problem(404, str(exc))


async def _bad_value(request: Request, exc: LightningRLError) -> Response:
    return problem(422, str(exc))


async def _store_down(request: Request, exc: StoreError) -> Response:
    return problem(503, f"the store could not complete the request: {exc}; retry later")


async def _invalid(request: Request, exc: ValidationError) -> Response:
    return problem(422, "invalid value", validation_details(exc))


async def _invalid_query(request: Request, exc: RequestValidationError) -> Response:
    details = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:20]]
    return problem(422, "invalid parameter", details)


#: the answer to each error a route raises (the most specific class wins: a StoreError is 503, another
#: LightningRLError 422)
ERROR_ANSWERS = ((_Refused, _refused), (RolloutNotFoundError, _not_found), (LightningRLError, _bad_value),
                 (StoreError, _store_down), (ValidationError, _invalid), (RequestValidationError, _invalid_query))


class StoreRoutes:
    """Every route of one server over ``store``, with the one thing the server remembers between requests:
    rollout ids known to exist (only ever ids already in the store, so any number of servers may serve one
    PostgreSQL database; ``http/server.py``'s doc)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._known: OrderedDict[str, None] = OrderedDict()  # rollout ids in the store (most recent last)
        self._known_lock = threading.Lock()  # used from the event loop and from worker threads
        self._lease_waiters: anyio.CapacityLimiter | None = None  # made on the first waiting lease (needs the loop)

    def add_to(self, app: Any) -> None:
        """The error answers and the routes, on ``app`` (the routes in this order: the OpenAPI document's)."""
        for error, answer in ERROR_ANSWERS:
            app.add_exception_handler(error, answer)
        p = wire.API_PREFIX
        app.get(f"{p}/health")(self.health)
        app.get(f"{p}/stats")(self.server_stats)
        app.post(f"{p}/batch", response_model=wire.BatchResult, openapi_extra=body_schema(wire.Batch))(self.batch)
        app.post(f"{p}/rewards", response_model=Reward, openapi_extra=body_schema(wire.RewardIn))(self.add_reward)
        app.get(f"{p}/rewards", response_model=wire.RewardedSince)(self.rewarded_since)
        # publishes and the decisions about them
        app.post(f"{p}/policies", response_model=PolicyRecord,
                 openapi_extra=body_schema(wire.PolicyIn))(self.record_policy)
        app.post(f"{p}/decisions", response_model=PolicyDecision,
                 openapi_extra=body_schema(wire.DecisionIn))(self.record_decision)
        app.get(f"{p}/decisions", response_model=list[PolicyDecision])(self.decisions)
        app.get(f"{p}/policies", response_model=list[PolicyRecord])(self.policies)
        # rollouts
        app.get(f"{p}/rollouts", response_model=list[Rollout])(self.rollouts)
        app.post(f"{p}/rollouts/page", response_model=RolloutPage,
                 openapi_extra=body_schema(RolloutQuery))(self.rollout_page)
        app.get(f"{p}/rollouts/{{rollout_id}}", response_model=Rollout)(self.rollout)
        app.get(f"{p}/rollouts/{{rollout_id}}/spans", response_model=list[Span])(self.spans)
        app.get(f"{p}/rollouts/{{rollout_id}}/rewards", response_model=list[Reward])(self.rewards)
        app.get(f"{p}/rollouts/{{rollout_id}}/trajectory")(self.trajectory)
        app.post(f"{p}/rollout_data", response_model=list[wire.RolloutData],
                 openapi_extra=body_schema(wire.RolloutIdsIn))(self.rollout_data)
        app.post(f"{p}/rollouts/delete", response_model=wire.Deleted,
                 openapi_extra=body_schema(wire.DeleteRolloutsIn))(self.delete_rollouts)
        app.get(f"{p}/rollout_ids")(self.rollout_ids)
        app.get(f"{p}/quarantine", response_model=list[QuarantinedRecord])(self.quarantine)
        # the task queue: enqueue, lease, heartbeat, complete, cancel, entries
        app.post(f"{p}/queue/enqueue", response_model=list[QueueEntry],
                 openapi_extra=body_schema(wire.EnqueueIn))(self.enqueue)
        app.post(f"{p}/queue/lease", response_model=list[QueueEntry],
                 openapi_extra=body_schema(wire.LeaseIn))(self.lease)
        app.post(f"{p}/queue/heartbeat", response_model=wire.Ok,
                 openapi_extra=body_schema(wire.HeartbeatIn))(self.heartbeat)
        app.post(f"{p}/queue/complete", response_model=wire.Ok,
                 openapi_extra=body_schema(wire.CompleteIn))(self.complete)
        app.post(f"{p}/queue/cancel", response_model=wire.Cancelled,
                 openapi_extra=body_schema(wire.CancelIn))(self.cancel)
        app.post(f"{p}/queue/entries", response_model=list[QueueEntry],
                 openapi_extra=body_schema(wire.GroupsIn))(self.queue_entries)

    # -- the rollout ids known to exist

    def remember(self, ids: set[str]) -> None:
        with self._known_lock:
            for rid in ids:
                self._known[rid] = None
                self._known.move_to_end(rid)
            while len(self._known) > KNOWN_CACHE:
                self._known.popitem(last=False)

    def forget(self, ids: list[str]) -> None:
        with self._known_lock:  # a later batch naming them is checked against the store again
            for rid in ids:
                self._known.pop(rid, None)

    def unknown_rollouts(self, ids: set[str]) -> set[str]:
        with self._known_lock:
            missing = {rid for rid in ids if rid not in self._known}
        if missing:
            found = self.store.existing_rollout_ids(missing)
            self.remember(found)
            missing -= found
        return missing

    # -- health, writes, rewards

    async def health(self) -> dict:
        store = self.store
        return {"ok": True, "store": getattr(store, "shown", store.url),  # never a password in the URL
                "pending_writes": getattr(store, "pending_writes", 0),
                "synchronous": getattr(store, "synchronous", None)}

    async def server_stats(self) -> dict:
        return counters()

    async def batch(self, request: Request) -> Response:
        """Write ops (start_rollout, span, reward, finish_rollout) atomically and idempotently."""
        ops = (await body_of(request, wire.Batch)).ops
        errors, started, referred, refers = wire.check_ops(ops)
        if errors:
            raise _Refused(422, f"{len(errors)} invalid value(s) in the batch; nothing was written", errors,
                           wire.op_indices(errors))
        missing = await anyio.to_thread.run_sync(self.unknown_rollouts, referred - started)
        if missing:
            shown = ", ".join(sorted(repr(m) for m in missing)[:10])
            raise _Refused(422, f"unknown rollout id(s) {shown}; send their start_rollout op first (in this "
                                "or an earlier batch); nothing was written", [],
                           sorted(i for i, rid in refers.items() if rid in missing))
        await anyio.to_thread.run_sync(self.store.write_batch, wire.to_ops(ops))
        self.remember(started)
        return json_response({"accepted": len(ops)})

    async def add_reward(self, request: Request) -> Response:
        """A late reward (user feedback), durable on return. Idempotent when ``uid`` is given."""
        data = await body_of(request, wire.RewardIn)
        reward = await anyio.to_thread.run_sync(lambda: self.store.add_reward(
            data.rollout_id, data.value, data.name, llm_call_index=data.llm_call_index, agent=data.agent,
            source=data.source, uid=data.uid))
        return json_response(reward.model_dump(mode="json"))

    async def rewarded_since(self, after: QueryInt = 0, name: str | None = None, limit: QueryInt = 10_000) -> Response:
        """Rollouts rewarded since position ``after`` (a continuous trainer's poll)."""
        ids, position = await anyio.to_thread.run_sync(lambda: self.store.rewarded_since(after, name=name,
                                                                                         limit=limit))
        return json_response({"rollout_ids": ids, "position": position})

    # -- publishes and the decisions about them

    async def record_policy(self, request: Request) -> Response:
        """Record a publish (durable on return); every process stamps its LLM calls from these."""
        data = await body_of(request, wire.PolicyIn)
        record = await anyio.to_thread.run_sync(lambda: self.store.record_policy(
            data.served_name, data.version, adapter=data.adapter, time=data.time, trained_on=data.trained_on,
            served_as=data.served_as))
        return json_response(policy_json(record))

    async def record_decision(self, request: Request) -> Response:
        """Record a decision about a served name's policy (the gate's, a rollback), durable on return."""
        data = await body_of(request, wire.DecisionIn)
        record = await anyio.to_thread.run_sync(lambda: self.store.record_decision(
            data.served_name, data.version, data.decision, live_version=data.live_version, adapter=data.adapter,
            figures=data.figures, reason=data.reason, time=data.time))
        return json_response(record.model_dump(mode="json"))

    async def decisions(self, served_name: str | None = None, latest: bool = False) -> Response:
        """Recorded decisions, oldest first (of ``served_name``, or all); ``latest``: the last one about each
        served name (a canary in progress, ``continuous.py``)."""
        store = self.store

        def read() -> list[PolicyDecision]:
            if latest:
                return [d for d in store.latest_decisions().values() if served_name in (None, d.served_name)]
            return store.decisions(served_name)

        found = await anyio.to_thread.run_sync(read)
        return json_response([r.model_dump(mode="json") for r in found])

    async def policies(self, served_name: str | None = None, latest: bool = False) -> Response:
        """Recorded publishes, oldest first; ``latest``: the last one of each served name."""
        store = self.store

        def read() -> list[PolicyRecord]:
            if latest:
                return [p for p in store.latest_policies().values() if served_name in (None, p.served_name)]
            return store.policies(served_name)

        found = await anyio.to_thread.run_sync(read)
        return json_response([policy_json(r) for r in found])

    # -- rollouts

    async def rollouts(self, mode: str | None = None, status: str | None = None, since: float | None = None,
                       min_policy_version: QueryInt | None = None, limit: QueryInt | None = None,
                       newest_first: bool = False) -> Response:
        found = await anyio.to_thread.run_sync(lambda: self.store.rollouts(
            mode=mode, status=status, since=since, min_policy_version=min_policy_version, limit=limit,
            newest_first=newest_first))
        return json_response([r.model_dump(mode="json") for r in found])

    async def rollout_page(self, request: Request) -> Response:
        """A filtered, sorted page of rollouts with their reward sums (the viewer's list)."""
        query = await body_of(request, RolloutQuery)
        page = await anyio.to_thread.run_sync(lambda: self.store.rollout_page(query))
        return json_response(page.model_dump(mode="json"))

    async def rollout(self, rollout_id: str) -> Response:
        found = await anyio.to_thread.run_sync(self.store.get_rollout, rollout_id)
        return json_response(found.model_dump(mode="json"))

    async def spans(self, rollout_id: str) -> Response:
        found = await anyio.to_thread.run_sync(self.store.spans, rollout_id)
        return json_response([s.model_dump(mode="json") for s in found])

    async def rewards(self, rollout_id: str) -> Response:
        found = await anyio.to_thread.run_sync(self.store.rewards, rollout_id)
        return json_response([r.model_dump(mode="json") for r in found])

    async def trajectory(self, rollout_id: str, credit: str = "final", reward_name: str = "reward") -> Response:
        """The assembled trajectory with a built-in credit assignment (for clients in other languages)."""
        traj = await anyio.to_thread.run_sync(lambda: assemble_trajectory(self.store, rollout_id, credit=credit,
                                                                          reward_name=reward_name))
        return json_response(traj.model_dump(mode="json"))

    async def rollout_data(self, request: Request) -> Response:
        """Rollouts with their spans and rewards, many at once (clients assemble trajectories)."""
        ids = (await body_of(request, wire.RolloutIdsIn)).rollout_ids
        data = await anyio.to_thread.run_sync(lambda: list(self.store.rollout_data(ids)))
        return json_response([{"rollout": r.model_dump(mode="json"), "spans": [s.model_dump(mode="json") for s in sp],
                               "rewards": [w.model_dump(mode="json") for w in rw]} for r, sp, rw in data])

    async def delete_rollouts(self, request: Request) -> Response:
        """Erase rollouts with their spans, rewards, queue entries and quarantined records (``store/erasure.py``);
        the number removed (unknown ids are ignored)."""
        data = await body_of(request, wire.DeleteRolloutsIn)
        self.forget(data.rollout_ids)
        deleted = await anyio.to_thread.run_sync(lambda: self.store.delete_rollouts(data.rollout_ids, full=data.full))
        return json_response({"deleted": deleted})

    async def rollout_ids(self, prefix: str, limit: Annotated[int, Query(ge=1, le=1000)] = 11) -> Response:
        """Rollout ids starting with ``prefix`` (a unique prefix names a rollout in the CLI), in order."""
        return json_response(await anyio.to_thread.run_sync(lambda: self.store.rollout_ids_with_prefix(prefix, limit)))

    async def quarantine(self, limit: QueryInt = 1000) -> Response:
        """Records the store set aside because they could not be written (newest first, with the reason)."""
        found = await anyio.to_thread.run_sync(lambda: self.store.quarantined(limit=limit))
        return json_response([q.model_dump(mode="json") for q in found])

    # -- the task queue

    async def enqueue(self, request: Request) -> Response:
        data = await body_of(request, wire.EnqueueIn)
        entries = await anyio.to_thread.run_sync(lambda: self.store.enqueue(
            data.task, n=data.n, mode=data.mode, max_tries=data.max_tries, group_id=data.group_id, once=data.once,
            overrides=data.overrides))
        return json_response([wire.queue_entry_json(e) for e in entries])

    async def lease(self, request: Request) -> Response:
        """Lease tries; ``wait``: a long poll, held at most ``wire.MAX_LEASE_WAIT`` seconds, on threads of its
        own (a server full of idle runners' waits still answers every other request at once)."""
        data = await body_of(request, wire.LeaseIn)
        count("store_server_lease_requests")  # the requests idle runners send (``GET /v1/stats``)
        wait = min(data.wait, wire.MAX_LEASE_WAIT)
        if wait and self._lease_waiters is None:
            self._lease_waiters = anyio.CapacityLimiter(LEASE_WAITERS)
        entries = await anyio.to_thread.run_sync(lambda: self.store.lease(
            data.runner, lease_seconds=data.lease_seconds, limit=data.limit, key=data.key, wait=wait),
            limiter=self._lease_waiters if wait else None)
        return json_response([wire.queue_entry_json(e) for e in entries])

    async def heartbeat(self, request: Request) -> Response:
        data = await body_of(request, wire.HeartbeatIn)
        ok = await anyio.to_thread.run_sync(lambda: self.store.heartbeat(
            data.queue_id, data.runner, lease_seconds=data.lease_seconds, rollout_id=data.rollout_id))
        return json_response({"ok": ok})

    async def complete(self, request: Request) -> Response:
        data = await body_of(request, wire.CompleteIn)
        ok = await anyio.to_thread.run_sync(lambda: self.store.complete(
            data.queue_id, data.runner, data.outcome, rollout_id=data.rollout_id))
        return json_response({"ok": ok})

    async def cancel(self, request: Request) -> Response:
        """Cancel queued or leased tries (``TaskQueue.cancel``); the ids among those named that are cancelled."""
        data = await body_of(request, wire.CancelIn)
        cancelled = await anyio.to_thread.run_sync(lambda: self.store.cancel(data.queue_ids, reason=data.reason))
        return json_response({"cancelled": cancelled})

    async def queue_entries(self, request: Request) -> Response:
        data = await body_of(request, wire.GroupsIn)
        refused = queue_listing_refused(request.scope, data.group_ids)  # a runner names its groups
        if refused is not None:
            count("store_server_forbidden")
            return json_response({"error": refused, "details": []}, 403)
        entries = await anyio.to_thread.run_sync(lambda: self.store.queue_entries(data.group_ids))
        return json_response([wire.queue_entry_json(e) for e in entries])
