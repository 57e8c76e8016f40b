"""The store over HTTP: the client backend (``http(s)://HOST:PORT``, several comma-separated to fail over) and
the store server it talks to (``lightning-rl store serve``), which serves any servable backend.

``client.py`` (``HttpStore``), ``writes.py`` (its batches, fail-over and spill), ``server.py`` (the app and
``serve``), ``routes.py`` (every route of the server), ``auth.py`` (tokens and roles). The wire format both sides
speak is ``store/wire/`` (spill files hold it too). Registered here for its URLs (``kit/backends.py``).
"""

from __future__ import annotations

from typing import Any

from ..kit.backends import StoreBackend, register_store_backend


def _location(url: str) -> str:
    return ",".join(part.strip().rstrip("/") for part in url.split(","))


def _open(location: str, **options: Any) -> Any:
    from .client import HttpStore

    return HttpStore(location, **options)


BACKEND = register_store_backend(StoreBackend(
    "http", ("http", "https"), _open,
    examples=("http(s)://HOST:PORT (lightning-rl store serve; several, comma-separated, to fail over)",),
    locate=_location, same=lambda a, b: set(a.split(",")) == set(b.split(",")),  # the servers, in any order
    shared=True))
