"""``lightning-rl store serve``: the store over HTTP, for many runner processes and machines.

FastAPI on uvicorn in front of one store: a SQLite file (:class:`SQLiteStore`) or a PostgreSQL database
(:class:`PostgresStore`, ``--db postgresql://user@host:5432/db``). Writes come as batches of idempotent ops
(``store/wire.py``), are validated completely before anything is written, and are answered once
durable: concurrent batches share the store's background writer, so they are committed together
(group commit). The queue, rewards and queries map one to one onto :class:`Store` methods.

* Stateless over PostgreSQL: any number of servers, on any machines, may serve one database. A server
  keeps nothing between requests that another would need: every write is idempotent in the database
  (rollouts by id, spans by ``(rollout_id, seq)``, rewards by uid, a lease by its key, an enqueue by its
  group id), the queue leases atomically there, and the one thing a server remembers (which rollout ids
  exist, to check a batch's references without a query) only ever holds ids already in the database. A
  client given several servers' URLs moves to the next when one fails (``http/client.py``).
* Auth: ``Authorization: Bearer <token>`` on every route but ``/v1/health`` and ``/openapi.json``;
  a token is required whenever the server binds to anything but loopback. Tokens have roles (``runner``,
  ``reader``, ``admin``) and every route names the roles that may call it (``http/auth.py``).
* Limits: request bodies over ``max_body_bytes`` get 413 before they are read in full.
* Errors: 400 malformed JSON, 401 bad or missing token, 403 a token without the route's role, 404 unknown rollout, 413 too large, 422
  invalid content (with every problem and its path), 503 the store cannot be written or read now (the
  database is away: the client retries elsewhere or spills). Nothing of a refused batch is written.
"""

from __future__ import annotations

import ctypes
import gc
import json
import multiprocessing
import os
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError

from ...errors import ConfigurationError, LightningRLError, RolloutNotFoundError, StoreError

try:
    import anyio
    from fastapi import FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
except ImportError as exc:  # the server is an extra; clients need only the core
    raise ConfigurationError(
        f"the store server needs FastAPI and uvicorn ({exc}); they come with lightning-rl: pip install fastapi uvicorn httptools (or reinstall lightning-rl)"
    ) from None
from ...boundaries import INT64_MAX
from ...diagnostics import count, counters
from ...records import QuarantinedRecord, Reward, Rollout, RolloutPage, RolloutQuery, Span
from ...settings import ENV_SERVER_WORKER, ENV_STORE_TOKEN, check_synchronous
from .. import wire
from ...serving import STORE_SERVER, BackgroundService, run
from ..protocols import Store
from ..queries import trajectory as assemble_trajectory
from .routes import BODY_DEFS as _BODY_DEFS
from .auth import SCOPE_ROLES, RouteRoles, Tokens, refusal, route_table
from .routes import add_policy_routes, add_queue_routes
from .routes import body_schema as _body_schema
from .routes import json_response as _json

DEFAULT_MAX_BODY = 64 * 2**20
OPEN_PATHS = frozenset({f"{wire.API_PREFIX}/health", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})  # the schema and its two HTML renderings are public
_KNOWN_CACHE = 200_000
_OP_TAGS = ("start_rollout", "span", "reward", "finish_rollout")


def _problem(status: int, error: str, details: list[str] | None = None,
             invalid_ops: list[int] | None = None) -> Response:
    body: dict[str, Any] = {"error": error, "details": details or []}
    if invalid_ops is not None:  # a refused batch: which ops to set aside (the client sends the rest again)
        body["invalid_ops"] = invalid_ops
    return _json(body, status)


class _Refused(Exception):
    def __init__(self, status: int, error: str, details: list[str] | None = None,
                 invalid_ops: list[int] | None = None) -> None:
        super().__init__(error)
        self.response = _problem(status, error, details, invalid_ops)


#: An integer query parameter: a count, a position or a version, stored or compared in SQLite.
QueryInt = Annotated[int, Query(ge=0, le=INT64_MAX)]


def _validation_details(exc: ValidationError) -> list[str]:
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


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise _Refused(400, "the request body is not valid JSON",
                           [e["msg"] for e in exc.errors(include_url=False)[:5]]) from None
        details = _validation_details(exc)
        raise _Refused(422, "the request body does not match the schema (see /openapi.json)", details,
                       wire.op_indices(details) if model is wire.Batch else None) from None


class _Guard:
    """ASGI middleware: bearer token, the role its route needs (``http/auth.py``) and body size, before any
    route reads the body."""

    def __init__(self, app: Any, tokens: Tokens, routes: RouteRoles, max_body: int) -> None:
        self.app = app
        self.tokens = tokens
        self.routes = routes
        self.max_body = max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.tokens.enabled and scope["path"] not in OPEN_PATHS:
            refused = self._refused(scope, headers)
            if refused is not None:
                return await refused(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                return await _problem(400, f"bad Content-Length {length[:40]!r}")(scope, receive, send)
            if too_big:
                return await self._too_big(scope, receive, send)
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _TooBig(self.max_body)
            return message

        await self.app(scope, limited_receive, send)  # _TooBig raised while reading: handled by the app

    def _refused(self, scope: dict, headers: dict) -> Response | None:
        """401 for no token or one this server does not know; 403 for a token without the route's role."""
        auth = headers.get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        roles = self.tokens.roles_of(given.strip()) if scheme.lower() == b"bearer" else None
        if roles is None:
            why = "missing" if not auth else "wrong"
            resp = _problem(401, f"{why} bearer token; send 'Authorization: Bearer <token>' with a token of the "
                                 f"server's ({ENV_STORE_TOKEN}, or one of its tokens file)")
            resp.headers["www-authenticate"] = "Bearer"
            return resp
        allowed = self.routes.allowed(scope["method"], scope["path"])
        if allowed is not None and not roles & allowed:
            count("store_server_forbidden")
            return _problem(403, refusal(scope["method"], scope["path"], roles, allowed))
        scope[SCOPE_ROLES] = roles  # for a route whose rule depends on the body (server_auth.queue_listing_refused)
        return None

    async def _too_big(self, scope: dict, receive: Any, send: Any) -> None:
        await _too_big_response(self.max_body)(scope, receive, send)


class _TooBig(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


def _too_big_response(limit: int) -> Response:
    return _problem(413, f"request body over the server's limit of {limit} bytes; send smaller batches "
                         f"(the client sends at most {wire.CLIENT_BATCH_OPS} ops per request)")


def _openapi_with_bodies(app: Any) -> Any:
    plain = app.openapi

    def openapi() -> dict:
        doc = plain()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(
            {k: v for k, v in _BODY_DEFS.items() if k not in doc["components"]["schemas"]})
        return doc

    return openapi


def create_app(store: Store, *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
               tokens_file: str | os.PathLike[str] | None = None) -> Any:
    """The ASGI app serving ``store``. ``token``: the admin bearer token; ``tokens_file``: tokens with roles
    (``http/auth.py``); neither: no auth (loopback only). Every route has a role (``server_auth.ROUTE_ROLES``)."""
    app = FastAPI(title="lightning-rl store", version=str(wire.API_PREFIX[2:]),
                  description="Rollouts, spans, rewards and the task queue of one lightning-rl store.")
    known: OrderedDict[str, None] = OrderedDict()  # rollout ids in the file (most recent last)
    known_lock = threading.Lock()  # used from the event loop and from worker threads

    def remember(ids: set[str]) -> None:
        with known_lock:
            for rid in ids:
                known[rid] = None
                known.move_to_end(rid)
            while len(known) > _KNOWN_CACHE:
                known.popitem(last=False)

    def unknown_rollouts(ids: set[str]) -> set[str]:
        with known_lock:
            missing = {rid for rid in ids if rid not in known}
        if missing:
            found = store.existing_rollout_ids(missing)
            remember(found)
            missing -= found
        return missing

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        return _parse(model, await request.body())

    @app.exception_handler(_Refused)
    async def _refused(request: Request, exc: _Refused) -> Response:
        return exc.response

    @app.exception_handler(_TooBig)
    async def _too_big(request: Request, exc: _TooBig) -> Response:
        return _too_big_response(exc.limit)

    @app.exception_handler(RolloutNotFoundError)
    async def _not_found(request: Request, exc: RolloutNotFoundError) -> Response:
        return _problem(404, str(exc))

    @app.exception_handler(LightningRLError)
    async def _bad_value(request: Request, exc: LightningRLError) -> Response:
        return _problem(422, str(exc))

    @app.exception_handler(StoreError)
    async def _store_down(request: Request, exc: StoreError) -> Response:
        return _problem(503, f"the store could not complete the request: {exc}; retry later")

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, exc: ValidationError) -> Response:
        return _problem(422, "invalid value", _validation_details(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid_query(request: Request, exc: RequestValidationError) -> Response:
        details = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:20]]
        return _problem(422, "invalid parameter", details)

    p = wire.API_PREFIX

    @app.get(f"{p}/health")
    async def health() -> dict:
        return {"ok": True, "store": getattr(store, "shown", store.url),  # never a password in the URL
                "pending_writes": getattr(store, "pending_writes", 0),
                "synchronous": getattr(store, "synchronous", None)}

    @app.get(f"{p}/stats")
    async def server_stats() -> dict:
        return counters()

    @app.post(f"{p}/batch", response_model=wire.BatchResult, openapi_extra=_body_schema(wire.Batch))
    async def batch(request: Request) -> Response:
        """Write ops (start_rollout, span, reward, finish_rollout) atomically and idempotently."""
        ops = (await body_of(request, wire.Batch)).ops
        errors, started, referred, refers = wire.check_ops(ops)
        if errors:
            raise _Refused(422, f"{len(errors)} invalid value(s) in the batch; nothing was written", errors,
                           wire.op_indices(errors))
        missing = await anyio.to_thread.run_sync(unknown_rollouts, referred - started)
        if missing:
            shown = ", ".join(sorted(repr(m) for m in missing)[:10])
            raise _Refused(422, f"unknown rollout id(s) {shown}; send their start_rollout op first (in this "
                                "or an earlier batch); nothing was written", [],
                           sorted(i for i, rid in refers.items() if rid in missing))
        await anyio.to_thread.run_sync(store.write_batch, wire.to_ops(ops))
        remember(started)
        return _json({"accepted": len(ops)})

    @app.post(f"{p}/rewards", response_model=Reward, openapi_extra=_body_schema(wire.RewardIn))
    async def add_reward(request: Request) -> Response:
        """A late reward (user feedback), durable on return. Idempotent when ``uid`` is given."""
        data = await body_of(request, wire.RewardIn)
        reward = await anyio.to_thread.run_sync(lambda: store.add_reward(
            data.rollout_id, data.value, data.name, llm_call_index=data.llm_call_index, agent=data.agent,
            source=data.source, uid=data.uid))
        return _json(reward.model_dump(mode="json"))

    @app.get(f"{p}/rewards", response_model=wire.RewardedSince)
    async def rewarded_since(after: QueryInt = 0, name: str | None = None, limit: QueryInt = 10_000) -> Response:
        """Rollouts rewarded since position ``after`` (a continuous trainer's poll)."""
        ids, position = await anyio.to_thread.run_sync(lambda: store.rewarded_since(after, name=name, limit=limit))
        return _json({"rollout_ids": ids, "position": position})

    add_policy_routes(app, store, p, body_of)

    @app.get(f"{p}/rollouts", response_model=list[Rollout])
    async def rollouts(mode: str | None = None, status: str | None = None, since: float | None = None,
                       min_policy_version: QueryInt | None = None, limit: QueryInt | None = None,
                       newest_first: bool = False) -> Response:
        found = await anyio.to_thread.run_sync(lambda: store.rollouts(
            mode=mode, status=status, since=since, min_policy_version=min_policy_version, limit=limit,
            newest_first=newest_first))
        return _json([r.model_dump(mode="json") for r in found])

    @app.post(f"{p}/rollouts/page", response_model=RolloutPage, openapi_extra=_body_schema(RolloutQuery))
    async def rollout_page(request: Request) -> Response:
        """A filtered, sorted page of rollouts with their reward sums (the viewer's list)."""
        query = await body_of(request, RolloutQuery)
        page = await anyio.to_thread.run_sync(lambda: store.rollout_page(query))
        return _json(page.model_dump(mode="json"))

    @app.get(f"{p}/rollouts/{{rollout_id}}", response_model=Rollout)
    async def rollout(rollout_id: str) -> Response:
        return _json((await anyio.to_thread.run_sync(store.get_rollout, rollout_id)).model_dump(mode="json"))

    @app.get(f"{p}/rollouts/{{rollout_id}}/spans", response_model=list[Span])
    async def spans(rollout_id: str) -> Response:
        return _json([s.model_dump(mode="json") for s in await anyio.to_thread.run_sync(store.spans, rollout_id)])

    @app.get(f"{p}/rollouts/{{rollout_id}}/rewards", response_model=list[Reward])
    async def rewards(rollout_id: str) -> Response:
        return _json([r.model_dump(mode="json") for r in await anyio.to_thread.run_sync(store.rewards, rollout_id)])

    @app.get(f"{p}/rollouts/{{rollout_id}}/trajectory")
    async def trajectory(rollout_id: str, credit: str = "final", reward_name: str = "reward") -> Response:
        """The assembled trajectory with a built-in credit assignment (for clients in other languages)."""
        traj = await anyio.to_thread.run_sync(lambda: assemble_trajectory(store, rollout_id, credit=credit,
                                                                          reward_name=reward_name))
        return _json(traj.model_dump(mode="json"))

    @app.post(f"{p}/rollout_data", response_model=list[wire.RolloutData],
              openapi_extra=_body_schema(wire.RolloutIdsIn))
    async def rollout_data(request: Request) -> Response:
        """Rollouts with their spans and rewards, many at once (clients assemble trajectories)."""
        ids = (await body_of(request, wire.RolloutIdsIn)).rollout_ids
        data = await anyio.to_thread.run_sync(lambda: list(store.rollout_data(ids)))
        return _json([{"rollout": r.model_dump(mode="json"), "spans": [s.model_dump(mode="json") for s in sp],
                       "rewards": [w.model_dump(mode="json") for w in rw]} for r, sp, rw in data])

    @app.post(f"{p}/rollouts/delete", response_model=wire.Deleted, openapi_extra=_body_schema(wire.DeleteRolloutsIn))
    async def delete_rollouts(request: Request) -> Response:
        """Erase rollouts with their spans, rewards, queue entries and quarantined records (``store/erasure.py``);
        the number removed (unknown ids are ignored)."""
        data = await body_of(request, wire.DeleteRolloutsIn)
        with known_lock:  # a later batch naming them is checked against the store again
            for rid in data.rollout_ids:
                known.pop(rid, None)
        deleted = await anyio.to_thread.run_sync(lambda: store.delete_rollouts(data.rollout_ids, full=data.full))
        return _json({"deleted": deleted})

    @app.get(f"{p}/rollout_ids")
    async def rollout_ids(prefix: str, limit: Annotated[int, Query(ge=1, le=1000)] = 11) -> Response:
        """Rollout ids starting with ``prefix`` (a unique prefix names a rollout in the CLI), in order."""
        return _json(await anyio.to_thread.run_sync(lambda: store.rollout_ids_with_prefix(prefix, limit)))

    @app.get(f"{p}/quarantine", response_model=list[QuarantinedRecord])
    async def quarantine(limit: QueryInt = 1000) -> Response:
        """Records the store set aside because they could not be written (newest first, with the reason)."""
        found = await anyio.to_thread.run_sync(lambda: store.quarantined(limit=limit))
        return _json([q.model_dump(mode="json") for q in found])

    add_queue_routes(app, store, p, body_of)

    app.openapi = _openapi_with_bodies(app)
    return _Guard(app, Tokens(token, tokens_file), route_table(app, OPEN_PATHS), max_body_bytes), app




def served_store(db: str | os.PathLike[str], *, synchronous: str | None = None, **options: Any) -> Store:
    """The store a server writes to: ``postgresql://user@host:port/db`` (a :class:`PostgresStore`), else a
    SQLite file (a path or ``sqlite:///path``; ``synchronous``: SQLite's, refused for PostgreSQL, whose
    durability is the database's own)."""
    from ..uri import parse_store_url, store_backend

    backend = store_backend(os.fspath(db))
    if not backend.servable:
        raise ConfigurationError(f"a store server serves a SQLite file or a PostgreSQL database, not {os.fspath(db)!r:.200}; "
                                 "give --db runs.db or --db postgresql://USER@HOST:PORT/DATABASE")
    if synchronous is not None:
        if "synchronous" not in backend.options:
            raise ConfigurationError(f"synchronous={synchronous!r} is SQLite's; a PostgreSQL store is as durable as the "
                                     "database's own settings (synchronous_commit): leave it out")
        options["synchronous"] = synchronous
    return backend.open(parse_store_url(os.fspath(db))[1], **options)


def _die_with_the_supervisor() -> None:
    """A worker of a multi-process server ends when its supervisor does, even one killed with SIGKILL (Linux's
    ``PR_SET_PDEATHSIG``): a killed server must not leave workers answering on its port."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the supervisor is gone already
        os._exit(1)


def _worker_app() -> Any:
    """One worker process's app (uvicorn imports this factory in every worker)."""
    if multiprocessing.parent_process() is not None:  # a worker of several (not the one process of workers=1)
        _die_with_the_supervisor()
    args = json.loads(os.environ[ENV_SERVER_WORKER])
    _tune_gc()
    store = served_store(args["db"], synchronous=args.get("synchronous"))
    guarded, _ = create_app(store, token=args["token"], max_body_bytes=args["max_body_bytes"],
                            tokens_file=args.get("tokens_file"))
    return guarded


def _tune_gc() -> None:
    # A parsed batch is tens of thousands of small containers; with the default thresholds the
    # collector rescans them many times per batch (measured: 16x the cost of building the rows).
    # Nothing here makes reference cycles worth collecting that often.
    gc.set_threshold(50_000, 20, 100)


def serve(db: str, *, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY, log_level: str = "warning", workers: int = 2,
          synchronous: str | None = None, announce: Callable[[], None] | None = None,
          tokens_file: str | os.PathLike[str] | None = None) -> None:
    """Run the server until interrupted (SIGINT/SIGTERM); the store is flushed and closed on the way out.

    ``db``: a SQLite file, or ``postgresql://user@host:port/db[?schema=NAME]``. ``workers`` > 1 runs that
    many processes on one port, each parsing requests and writing to the same store (SQLite's WAL: one
    write transaction at a time, parsing in parallel; PostgreSQL: in parallel). Over PostgreSQL any number
    of such servers, on any machines, may serve one database (the module doc).

    ``synchronous`` (SQLite only): ``full`` (the default) fsyncs each commit, so an acknowledged batch
    survives a power loss (group commit spreads the fsync over every batch in the transaction);
    ``normal`` survives a killed server.

    ``token``: the admin token; ``tokens_file``: tokens with roles, re-read when it changes (``http/auth.py``)."""
    from ...serving import check_bind
    from ..uri import store_backend

    tokens_file = os.path.abspath(tokens_file) if tokens_file else None
    Tokens(token, tokens_file)  # a bad tokens file is refused before the store is touched
    secured = token or tokens_file  # check_bind asks only whether clients must authenticate
    check_bind(STORE_SERVER, host, secured)  # before the store is touched
    if "synchronous" in store_backend(db).options:
        synchronous = check_synchronous(synchronous or "full")
    elif synchronous is not None:
        check_synchronous(synchronous)
    served_store(db, synchronous=synchronous).close()  # create and migrate once, refusing foreign stores
    os.environ[ENV_SERVER_WORKER] = json.dumps({"db": os.fspath(db), "token": token, "max_body_bytes": max_body_bytes,
                                                "synchronous": synchronous, "tokens_file": tokens_file})
    run(STORE_SERVER, f"{__name__}:_worker_app", host=host, port=port, token=secured, log_level=log_level,
        announce=announce, factory=True, workers=workers, timeout_graceful_shutdown=10)


class BackgroundServer(BackgroundService):
    """The server on a thread of this process (tests, notebooks, one-process set-ups); it owns its store.

    ``with BackgroundServer("runs.db") as srv: open_store(srv.url)``. Port 0 picks a free port. ``db``: a
    SQLite file or a ``postgresql://`` URL; ``store_options``: the store's keyword arguments."""

    def __init__(self, db: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
                 store_options: dict[str, Any] | None = None,
                 tokens_file: str | os.PathLike[str] | None = None) -> None:
        from ...serving import check_bind

        Tokens(token, tokens_file)  # a bad tokens file is refused before the store is opened
        secured = token or (os.fspath(tokens_file) if tokens_file else None)
        check_bind(STORE_SERVER, host, secured)  # before the store is opened
        self.store = served_store(db, **(store_options or {}))
        guarded, self.app = create_app(self.store, token=token, max_body_bytes=max_body_bytes, tokens_file=tokens_file)
        super().__init__(STORE_SERVER, guarded, host=host, port=port, token=secured)

    def close(self) -> None:
        self.store.close()


def openapi_schema() -> str:
    """The OpenAPI document, without starting a server (``lightning-rl store openapi``)."""
    from ..uri import open_store

    _, app = create_app(open_store("memory://"))
    return json.dumps(app.openapi(), indent=2)


__all__ = ["BackgroundServer", "create_app", "serve", "served_store", "openapi_schema"]
