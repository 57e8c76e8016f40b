"""``lightning-rl store serve``: the store over HTTP, for many runner processes and machines.

FastAPI on uvicorn in front of one store: a SQLite file (:class:`SQLiteStore`) or a PostgreSQL database
(:class:`PostgresStore`, ``--db postgresql://user@host:5432/db``). Writes come as batches of idempotent ops
(``store/wire/``), are validated completely before anything is written, and are answered once
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
from collections.abc import Callable
from typing import Any

from ...errors import ConfigurationError

try:
    import anyio  # noqa: F401  (the routes' threads; checked here with the rest of the extra)
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
except ImportError as exc:  # the server is an extra; clients need only the core
    raise ConfigurationError(
        f"the store server needs FastAPI and uvicorn ({exc}); they come with lightning-rl: pip install fastapi uvicorn httptools (or reinstall lightning-rl)"
    ) from None
from ...diagnostics import count
from ...settings import ENV_SERVER_WORKER, ENV_STORE_TOKEN, check_synchronous, server_worker_args
from .. import wire
from ...serving import STORE_SERVER, BackgroundService, run
from ..protocols import Store
from .auth import SCOPE_ROLES, RouteRoles, Tokens, refusal, route_table
from .routes import BODY_DEFS as _BODY_DEFS
from .routes import StoreRoutes
from .routes import problem as _problem

DEFAULT_MAX_BODY = 64 * 2**20
OPEN_PATHS = frozenset({f"{wire.API_PREFIX}/health", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})  # the schema and its two HTML renderings are public


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


async def _too_big_answer(request: Request, exc: _TooBig) -> Response:
    return _too_big_response(exc.limit)


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
    """The ASGI app serving ``store`` (its routes: ``http/routes.py``), and the FastAPI app behind the guard.
    ``token``: the admin bearer token; ``tokens_file``: tokens with roles (``http/auth.py``); neither: no auth
    (loopback only). Every route has a role (``server_auth.ROUTE_ROLES``)."""
    app = FastAPI(title="lightning-rl store", version=str(wire.API_PREFIX[2:]),
                  description="Rollouts, spans, rewards and the task queue of one lightning-rl store.")
    app.add_exception_handler(_TooBig, _too_big_answer)
    StoreRoutes(store).add_to(app)
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
    args = server_worker_args()
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
