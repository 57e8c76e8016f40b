"""The SQLite backend: the embedded default (``sqlite:///PATH`` or a plain file path).

``store.py`` (``SQLiteStore``: WAL, one background writer per process, spill files), ``writes.py`` (a batch in
one transaction), ``reads.py`` (the queries in SQL), ``migrations.py`` (the schema, upgraded in place),
``connections.py`` (how a connection is opened). Registered here for its URLs (``kit/backends.py``).
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import ConfigurationError
from ..kit.backends import StoreBackend, register_store_backend


def _location(url: str) -> str:
    if "://" not in url:
        return url
    path = url.split("://", 1)[1]
    if not path.startswith("/") or path == "/":
        raise ConfigurationError(f"store URL {url!r} has no path; write sqlite:///runs.db (three slashes)")
    return path[1:]  # sqlite:///runs.db -> runs.db ; sqlite:////abs -> /abs


def _open(location: str, **options: Any) -> Any:
    from .store import SQLiteStore

    return SQLiteStore(location, **options)


def _schema_version() -> int:
    from .migrations import latest_version

    return latest_version()


BACKEND = register_store_backend(StoreBackend(
    "sqlite", ("sqlite",), _open, examples=("sqlite:///PATH", "a plain file path"), locate=_location,
    same=lambda a, b: os.path.abspath(a) == os.path.abspath(b), servable=True,
    options=frozenset({"synchronous", "vacuum"}), absolute_url=lambda where: "sqlite:///" + os.path.abspath(where),
    schema_version=_schema_version))
