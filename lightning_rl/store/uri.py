"""``open_store(url)``: store URLs to store objects."""

from __future__ import annotations

import os

from ..errors import ConfigurationError
from .base import Store

SCHEMES = ("sqlite:///PATH", "a plain file path", "memory://", "http(s)://HOST:PORT (lightning-rl store serve)")


def open_store(url: str | os.PathLike[str] | None = None) -> Store:
    """``sqlite:///runs.db`` (relative), ``sqlite:////abs/runs.db``, a plain path, ``memory://``, or
    ``http://host:port`` of a store server (token from ``LIGHTNING_RL_STORE_TOKEN``).
    Without ``url``: ``LIGHTNING_RL_STORE`` or ``./lightning_rl.db``."""
    if url is None:
        from ..settings import Settings

        url = Settings.from_env().store
    url = os.fspath(url)
    if url.startswith("memory://"):
        from .memory_store import InMemoryStore

        return InMemoryStore()
    if url.startswith(("http://", "https://")):
        from .http_store import HttpStore

        return HttpStore(url)
    if url.startswith("sqlite://"):
        path = url[len("sqlite://"):]
        if not path.startswith("/") or path == "/":
            raise ConfigurationError(f"store URL {url!r} has no path; write sqlite:///runs.db (three slashes)")
        path = path[1:]  # sqlite:///runs.db -> runs.db ; sqlite:////abs -> /abs
    elif "://" in url:
        scheme = url.split("://", 1)[0]
        raise ConfigurationError(
            f"store URL scheme {scheme!r} in {url!r} is not supported; use one of: {', '.join(SCHEMES)}"
        )
    else:
        path = url
    from .sqlite_store import SQLiteStore

    return SQLiteStore(path)
