"""``open_store(url)``: store URLs to store objects."""

from __future__ import annotations

import os
import re

from ..errors import ConfigurationError
from .kit.backends import DEFAULT, StoreBackend, backend_for_scheme, backend_named, known_urls
from .protocols import Store

_CREDENTIALS = re.compile(r"(:/{1,2}[^/@\s:,]*):[^/@\s,]*@")
_ONE_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def redacted(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (what messages and listings show)."""
    return _CREDENTIALS.sub(r"\1:***@", text)


def parse_store_url(url: str | os.PathLike[str] | None) -> tuple[str, str]:
    """``(backend, location)``: the name of the backend whose scheme the URL has (``kit/backends.py``:
    ``("memory", "")``, ``("http", urls)`` comma-separated, ``("postgres", url)``, ``("sqlite", path)``), and what
    that backend opens."""
    if url is None:
        from ..settings import Settings

        url = Settings.from_env().store
    url = os.fspath(url)
    if "://" in url:
        scheme = url.split("://", 1)[0]
        backend = backend_for_scheme(scheme)
        if backend is None:
            raise ConfigurationError(f"store URL scheme {scheme!r} in {redacted(url)!r} is not supported; use one of: "
                                     f"{', '.join(known_urls())}")
        return backend.name, (backend.locate or str)(url)
    typo = _ONE_SLASH.match(url)
    if typo:  # postgresql:/host/db would be a SQLite file of that name
        raise ConfigurationError(f"store URL {redacted(url)!r} has one slash after {typo.group(1)}:; write "
                                 f"{typo.group(1)}://...")
    backend = backend_named(DEFAULT)
    return backend.name, (backend.locate or str)(url)


def store_backend(url: str | os.PathLike[str] | None) -> StoreBackend:
    """The backend a URL names (its scheme's; a plain path: SQLite)."""
    return backend_named(parse_store_url(url)[0])


def same_store(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two URLs name the same store (``runs.db``, ``sqlite:///runs.db`` and its absolute path
    do; two ``memory://`` URLs never do: each opens a new store). The backend's ``same`` decides."""
    (kind_a, where_a), (kind_b, where_b) = parse_store_url(a), parse_store_url(b)
    same = backend_named(kind_a).same
    return kind_a == kind_b and same is not None and same(where_a, where_b)


def open_store(url: str | os.PathLike[str] | None = None, *, read_only: bool = False) -> Store:
    """``sqlite:///runs.db`` (relative), ``sqlite:////abs/runs.db``, a plain path, ``memory://``, or
    ``http://host:port`` of a store server (token from ``LIGHTNING_RL_STORE_TOKEN``; several servers of one
    store comma-separated, ``http://a:8765,http://b:8765``: the client fails over, ``http/client.py``), or
    ``postgresql://user@host:port/database[?schema=NAME]`` (``PostgresStore``, the ``postgres`` extra), or a
    URL of a registered backend (``kit/backends.py``).
    Without ``url``: ``LIGHTNING_RL_STORE`` or ``./lightning_rl.db``. ``read_only``: for readers that
    must change nothing (the viewer): no file is created or migrated, no spill file adopted or replayed."""
    kind, where = parse_store_url(url)
    return backend_named(kind).open(where, read_only=read_only)
