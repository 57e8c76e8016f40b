"""The PostgreSQL backend, for fleets (``postgresql://USER@HOST:PORT/DATABASE[?schema=NAME]``; the
``postgres`` extra).

``store.py`` (``PostgresStore``: a pool for reads and the queue, one background writer), ``sql.py`` (its
statements), ``schema.py`` (the schema and its migrations), ``queue.py`` (leasing in one statement,
LISTEN/NOTIFY). Registered here for its URLs (``kit/backends.py``); psycopg is imported only when one opens.
"""

from __future__ import annotations

from typing import Any

from ..kit.backends import StoreBackend, register_store_backend


def _open(location: str, **options: Any) -> Any:
    from .store import PostgresStore

    return PostgresStore(location, **options)


def _schema_version() -> int:
    from .schema import latest_version

    return latest_version()


BACKEND = register_store_backend(StoreBackend(
    "postgres", ("postgresql", "postgres"), _open, examples=("postgresql://USER@HOST:PORT/DATABASE",),
    shared=True, servable=True, schema_version=_schema_version))
