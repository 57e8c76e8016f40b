"""``open_store(url)``: store URLs to store objects."""

from __future__ import annotations

import os
import re

from ..errors import ConfigurationError
from .protocols import Store

SCHEMES = ("sqlite:///PATH", "a plain file path", "memory://",
           "http(s)://HOST:PORT (lightning-rl store serve; several, comma-separated, to fail over)",
           "postgresql://USER@HOST:PORT/DATABASE")


_CREDENTIALS = re.compile(r"(:/{1,2}[^/@\s:,]*):[^/@\s,]*@")
_ONE_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def redacted(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (what messages and listings show)."""
    return _CREDENTIALS.sub(r"\1:***@", text)


def parse_store_url(url: str | os.PathLike[str] | None) -> tuple[str, str]:
    """``(kind, location)``: ``("memory", "")``, ``("http", urls)`` (comma-separated), ``("postgres", url)`` or
    ``("sqlite", path)``."""
    if url is None:
        from ..settings import Settings

        url = Settings.from_env().store
    url = os.fspath(url)
    lower = url[:16].lower()
    if lower.startswith("memory://"):
        return "memory", ""
    if lower.startswith(("http://", "https://")):
        return "http", ",".join(part.strip().rstrip("/") for part in url.split(","))
    if lower.startswith(("postgresql://", "postgres://")):
        return "postgres", url
    if lower.startswith("sqlite://"):
        path = url[len("sqlite://"):]
        if not path.startswith("/") or path == "/":
            raise ConfigurationError(f"store URL {url!r} has no path; write sqlite:///runs.db (three slashes)")
        return "sqlite", path[1:]  # sqlite:///runs.db -> runs.db ; sqlite:////abs -> /abs
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise ConfigurationError(
            f"store URL scheme {scheme!r} in {redacted(url)!r} is not supported; use one of: {', '.join(SCHEMES)}"
        )
    typo = _ONE_SLASH.match(url)
    if typo:  # postgresql:/host/db would be a SQLite file of that name
        raise ConfigurationError(f"store URL {redacted(url)!r} has one slash after {typo.group(1)}:; write "
                                 f"{typo.group(1)}://...")
    return "sqlite", url


def store_kind(url: str | os.PathLike[str]) -> str:
    """``"sqlite"``, ``"memory"``, ``"http"`` or ``"postgres"``: which store a URL names."""
    return parse_store_url(url)[0]


def same_store(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two URLs name the same store (``runs.db``, ``sqlite:///runs.db`` and its absolute path
    do; two ``memory://`` URLs never do: each opens a new store)."""
    (kind_a, where_a), (kind_b, where_b) = parse_store_url(a), parse_store_url(b)
    if kind_a != kind_b or kind_a == "memory":
        return False
    if kind_a == "sqlite":
        return os.path.abspath(where_a) == os.path.abspath(where_b)
    if kind_a == "http":  # the same servers, in whatever order
        return set(where_a.split(",")) == set(where_b.split(","))
    return where_a == where_b


def open_store(url: str | os.PathLike[str] | None = None, *, read_only: bool = False) -> Store:
    """``sqlite:///runs.db`` (relative), ``sqlite:////abs/runs.db``, a plain path, ``memory://``, or
    ``http://host:port`` of a store server (token from ``LIGHTNING_RL_STORE_TOKEN``; several servers of one
    store comma-separated, ``http://a:8765,http://b:8765``: the client fails over, ``http_store.py``), or
    ``postgresql://user@host:port/database[?schema=NAME]`` (``PostgresStore``, the ``postgres`` extra).
    Without ``url``: ``LIGHTNING_RL_STORE`` or ``./lightning_rl.db``. ``read_only``: for readers that
    must change nothing (the viewer): no file is created or migrated, no spill file adopted or replayed."""
    kind, where = parse_store_url(url)
    if kind == "memory":
        from .memory_store import InMemoryStore

        return InMemoryStore()
    if kind == "http":
        from .http_store import HttpStore

        return HttpStore(where, read_only=read_only)
    if kind == "postgres":
        from .postgres_store import PostgresStore

        return PostgresStore(where, read_only=read_only)
    from .sqlite_store import SQLiteStore

    return SQLiteStore(where, read_only=read_only)
