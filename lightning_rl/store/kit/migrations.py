"""Schema migrations as a registry keyed by version, the rule every SQL backend keeps: versions run 1, 2, 3,
... with no gap and none twice, each with the title its store records (``_lightning_rl_migrations``).
A backend makes its registry with :func:`migration_registry` and registers with :func:`add_migration`;
a gap or a version twice is refused when the module loads, naming the number to use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ...errors import ConfigurationError
from ...registry import Registry

F = TypeVar("F", bound=Callable[..., Any])


def migration_registry(what: str, where: str) -> Registry[Any]:
    """A registry of ``what`` (e.g. "SQLite store migration") keyed by integer version, with a ``title`` trait;
    ``where`` names the module new ones are added in (for the hint of an unknown version)."""
    return Registry(what, key=int, traits={"title": ""},
                    hint=f"add the next one with @migration(version, title) in {where}")


def add_migration(registry: Registry[Any], version: int, title: str) -> Callable[[F], F]:
    """The decorator registering ``fn`` as the migration to schema ``version`` (the latest plus one), titled
    ``title``; a gap or a version twice raises :class:`ConfigurationError` naming the number to use."""
    register = registry.register(version, title=title)  # an integer version (refused otherwise)
    latest = max(registry.names()) if len(registry) else 0
    if version in registry:  # the registry refuses it too; said here with what the next number is
        raise ConfigurationError(f"{registry.what} {version} is registered already "
                                 f"({registry.trait(version, 'title')!r}); number the new one {latest + 1}")
    if version != latest + 1:
        raise ConfigurationError(f"{registry.what} {version} ({title!r}) would leave a gap: the latest is "
                                 f"{latest}; number it {latest + 1}")
    return register
