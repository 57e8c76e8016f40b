"""Store backends by URL scheme: the one registry every choice of store goes through.

A backend is a :class:`StoreBackend` registered under its name; it claims URL schemes
(``postgresql://`` ...) and says what its stores can do beyond the protocols (``shared``: every machine
of a run reaches the same store; ``servable``: ``lightning-rl store serve --db`` serves it; ``options``:
the SQLite-only options ``synchronous`` and ``vacuum``). ``open_store``, the store server, the CLI and the
verl launch ask it, never a ``kind ==`` branch. A URL without a scheme is a file path (the ``default``
backend, SQLite). The built-in four register themselves in their own package (``store/sqlite/__init__.py``,
``store/postgres/__init__.py``, ``store/http/__init__.py``, ``store/memory_store.py``), which
``lightning_rl.store`` imports; opening one imports its store module then (PostgreSQL's driver is optional).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigurationError
from ...registry import Registry


def _equal(a: str, b: str) -> bool:
    return a == b


@dataclass(frozen=True)
class StoreBackend:
    """How URLs of some schemes become stores. ``open(location, *, read_only=False, **options)`` makes one
    (``location``: what ``locate`` made of the URL); calling the backend does the same."""

    name: str
    schemes: tuple[str, ...]
    open: Callable[..., Any]
    #: How messages list its URLs (``sqlite:///PATH``); one entry each.
    examples: tuple[str, ...] = ()
    #: The URL (its scheme checked) -> the location ``open`` takes; the URL itself unless given.
    locate: Callable[[str], str] | None = None
    #: Whether two locations name one store; None: never (each open makes a new store, ``memory://``).
    same: Callable[[str, str], bool] | None = _equal
    #: A store every machine of a run reaches (a multi-node run needs one).
    shared: bool = False
    #: ``lightning-rl store serve --db`` serves a store of this backend.
    servable: bool = False
    #: The SQLite-only options it takes: ``synchronous`` (when a commit is on disk), ``vacuum``.
    options: frozenset[str] = field(default_factory=frozenset)
    #: A store named relative to this process (a file): its location as a URL any process opens the same.
    absolute_url: Callable[[str], str] | None = None
    #: The newest store schema this lightning-rl writes (``store migrate`` says it; None: the default backend's).
    schema_version: Callable[[], int] | None = None

    def __call__(self, location: str, **options: Any) -> Any:
        return self.open(location, **options)


STORE_BACKENDS: Registry[StoreBackend] = Registry(
    "store backend", hint="register one with lightning_rl.store.kit.register_store_backend (docs/extending.md)")
_BY_SCHEME: dict[str, str] = {}
DEFAULT = "sqlite"  # a URL without a scheme is a file path


def register_store_backend(backend: StoreBackend) -> StoreBackend:
    """Add ``backend``; a scheme another backend claims is refused, naming it."""
    for scheme in backend.schemes:
        held = _BY_SCHEME.get(scheme.lower())
        if held is not None:
            raise ConfigurationError(f"the store URL scheme {scheme!r}:// belongs to the {held!r} backend already; "
                                     f"register {backend.name!r} under another scheme")
    STORE_BACKENDS.add(backend.name, backend)
    _BY_SCHEME.update((scheme.lower(), backend.name) for scheme in backend.schemes)
    return backend


def backend_named(name: str) -> StoreBackend:
    return STORE_BACKENDS.get(name)


def backend_for_scheme(scheme: str) -> StoreBackend | None:
    name = _BY_SCHEME.get(scheme.lower())
    return None if name is None else STORE_BACKENDS.get(name)


def known_urls() -> list[str]:
    """Every backend's URL forms, as messages list them."""
    return [example for name in dict.fromkeys(_BY_SCHEME.values()) for example in STORE_BACKENDS.get(name).examples]
