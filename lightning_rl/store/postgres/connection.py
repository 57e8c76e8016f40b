"""What connecting a ``PostgresStore`` takes (``store.py``): psycopg 3, imported only then (its absence names
the extra to install); the URL parsed into what libpq connects with, the schema of the store's tables and the
URL as messages show it (``parse_url``); the local spill folder; and which failed writes are the records' own
fault rather than the database's (``is_record_error``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ...errors import ConfigurationError, MissingDependencyError, StoreError
from ...settings import spill_dir
from ..uri import redacted

DEFAULT_SCHEMA = "lightning_rl"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
SCHEMES = ("postgresql://", "postgres://")


def _psycopg() -> tuple[Any, Any]:
    try:
        import psycopg
        import psycopg_pool
    except ImportError:
        raise MissingDependencyError("a postgresql:// store needs psycopg 3; install it with: "
                                     "pip install 'lightning-rl[postgres]'") from None
    return psycopg, psycopg_pool


def parse_url(url: str) -> tuple[str, str, str]:
    """``(conninfo, schema, shown)``: the URL libpq connects with, the PostgreSQL schema of the store's
    tables (``?schema=NAME``), and the URL as messages show it (no password)."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not parts.path.strip("/"):
        raise ConfigurationError(f"store URL {redacted(url)!r:.200} is not postgresql://USER@HOST:PORT/DATABASE")
    try:
        parts.port
    except ValueError as exc:
        raise ConfigurationError(f"store URL {redacted(url)!r:.200}: {exc}; write postgresql://USER@HOST:5432/DATABASE") \
            from None
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((v for k, v in query if k == "schema"), DEFAULT_SCHEMA)
    if not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(f"schema={schema!r:.80} in the store URL is not a PostgreSQL name of lowercase letters, "
                                 "digits and underscores, at most 63, starting with a letter or _; e.g. "
                                 "?schema=lightning_rl")
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, rest, ""))
    host = parts.hostname or "localhost"
    user = f"{parts.username}@" if parts.username else ""
    shown = f"postgresql://{user}{host}{f':{parts.port}' if parts.port else ''}{parts.path}" + (
        f"?schema={schema}" if schema != DEFAULT_SCHEMA else "")
    return conninfo, schema, shown


def _spill_folder(url: str, schema: str) -> Path:
    configured = spill_dir()
    if configured:
        return Path(configured)
    parts = urlsplit(url)
    name = f"pg_{parts.hostname or 'localhost'}_{parts.port or 5432}_{parts.path.strip('/')}_{schema}"
    return Path.home() / ".cache" / "lightning-rl" / "spill" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def is_record_error(exc: BaseException) -> bool:
    """True when a write failed for the records themselves (a value PostgreSQL refuses, a constraint, text it
    cannot encode); False when the database could not be written at all (unreachable, restarting, full, a
    conflict between transactions): retried, then spilled."""
    psycopg, _ = _psycopg()
    if isinstance(exc, (psycopg.errors.DataError, psycopg.errors.IntegrityError)):
        return True
    if isinstance(exc, (psycopg.Error, OSError, MemoryError, StoreError)):  # StoreError: the writer's reconnect
        return False
    return True  # Python's own refusal of the values (an encoding error, a type it cannot adapt)
