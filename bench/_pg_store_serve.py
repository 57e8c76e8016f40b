"""The store server over PostgreSQL for the benchmarks: ``store/server.py``'s app over a ``PostgresStore``, run
by uvicorn with ``--workers`` processes on one port, as ``lightning-rl store serve`` runs its app over SQLite.

    python bench/_pg_store_serve.py postgresql://USER@HOST:PORT/DB --port 8765 [--workers 2]

(Until ``lightning-rl store serve --db postgresql://...`` is on the main line, the benchmark starts the
server app itself, with the same app, the same uvicorn options and the same garbage-collector tuning.)
"""

from __future__ import annotations

import argparse
import json
import os

_ENV = "LIGHTNING_RL_BENCH_PG_SERVER"


def _worker_app():
    """One worker's app (uvicorn imports this factory in every worker process)."""
    from lightning_rl.store.postgres_store import PostgresStore
    from lightning_rl.store.server import _tune_gc, create_app

    _tune_gc()
    guarded, _ = create_app(PostgresStore(json.loads(os.environ[_ENV])["url"]))
    return guarded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    from lightning_rl.serving import STORE_SERVER, run
    from lightning_rl.store.postgres_store import PostgresStore

    PostgresStore(args.url).close()  # create and migrate once, before any worker starts (as serve does)
    os.environ[_ENV] = json.dumps({"url": args.url})
    run(STORE_SERVER, "_pg_store_serve:_worker_app", host="127.0.0.1", port=args.port, token=None,
        log_level="warning", factory=True, workers=args.workers, timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
