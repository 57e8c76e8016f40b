"""One registry type behind every named extension point (credit assigners, advantage estimators, policy
losses, reward helpers, weight publishers, experiment trackers, framework adapters, capture dialects,
agent-name resolvers, SQLite migrations).

As verl's ``core_algos.py`` does it: a plain mapping filled by a decorator that returns the function
unchanged, so every registered function stays directly callable and testable. Two rules everywhere:

* a name is registered once; registering it again is refused (:class:`~lightning_rl.errors.ConfigurationError`
  naming what holds it), so one plugin cannot silently replace another's function;
* an unknown name fails listing the known ones (:class:`~lightning_rl.errors.UnknownNameError`), unless the
  caller gives a default (``get(name, None)``, as a dict's ``get``).

::

    CREDIT = Registry("credit assignment", hint="register one with @lightning_rl.register_credit")

    @CREDIT.register("final")
    def final_credit(n, final, steps): ...

    CREDIT.get("final") is final_credit

Four options, each used by a table that needs it:

* ``of=Dialect``: entries are instances of that type instead of callables (the capture dialects);
* ``key=int``: names are integers, not strings (the SQLite migrations, keyed by schema version);
* ``ordered=True``: ``names()``, iteration and ``values()`` follow registration order instead of the names'
  sort (the agent-name resolvers: the first registered is asked first);
* ``traits={"needs_groups": False}``: what an entry may declare about itself, with the defaults; declared
  with ``register(name, needs_groups=True)`` and read with ``trait(name, "needs_groups")``. An undeclared
  trait is refused, so a misspelt one cannot pass silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from .errors import ConfigurationError, UnknownNameError, shown

T = TypeVar("T")
_MISSING: Any = object()


def _where(obj: object) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if module and name else shown(obj)


class Registry(Generic[T]):
    """Names to functions (or factories, or ``of`` instances) of one kind. ``what`` names the kind in
    messages; ``hint`` says how to add one."""

    def __init__(self, what: str, *, hint: str = "", of: type | None = None, key: type = str,
                 ordered: bool = False, traits: Mapping[str, Any] | None = None) -> None:
        if key not in (str, int):
            raise ConfigurationError(f"a registry's names are str or int, got key={shown(key)}")
        self.what = what
        self.hint = hint
        self.of = of
        self.key = key
        self.ordered = ordered
        self._defaults: dict[str, Any] = dict(traits or {})
        self._entries: dict[Any, T] = {}
        self._traits: dict[Any, dict[str, Any]] = {}

    def _check_name(self, name: object) -> None:
        if self.key is int:
            if not isinstance(name, int) or isinstance(name, bool):
                raise ConfigurationError(f"a {self.what} is registered under an integer, got {shown(name)}")
        elif not isinstance(name, str) or not name:
            raise ConfigurationError(f"a {self.what} is registered under a non-empty string name, got {shown(name)}")

    def _check_traits(self, name: object, traits: Mapping[str, Any]) -> None:
        unknown = sorted(set(traits) - set(self._defaults))
        if unknown:
            known = ", ".join(sorted(self._defaults)) or "none"
            raise ConfigurationError(f"a {self.what} declares no trait {unknown[0]!r} (for {name!r}); "
                                     f"known traits: {known}")

    def register(self, name: Any, **traits: Any) -> Callable[[T], T]:
        """A decorator: ``@registry.register("name")`` records the function and returns it unchanged;
        ``traits`` are what the entry declares about itself (among those the registry was made with)."""
        self._check_name(name)
        self._check_traits(name, traits)

        def add(obj: T) -> T:
            self.add(name, obj, **traits)
            return obj

        return add

    def add(self, name: Any, obj: T, **traits: Any) -> None:
        """Record ``obj`` under ``name`` (what ``register`` does, without the decorator)."""
        self._check_name(name)
        self._check_traits(name, traits)
        if self.of is not None:
            if not isinstance(obj, self.of):
                raise ConfigurationError(f"a {self.what} must be a {self.of.__name__}, got {shown(obj)} for {name!r}")
        elif not callable(obj):
            raise ConfigurationError(f"a {self.what} must be callable, got {shown(obj)} for {name!r}")
        held = self._entries.get(name)
        if held is not None:
            raise ConfigurationError(f"a {self.what} named {name!r} is registered already ({_where(held)}); "
                                     f"register {_where(obj)} under another name")
        if traits:
            self._traits[name] = dict(traits)
        self._entries[name] = obj

    def get(self, name: Any, default: Any = _MISSING) -> T:
        """The entry registered as ``name``; an unknown name raises, listing the known ones, unless a
        ``default`` is given (returned instead)."""
        try:
            entry = self._entries.get(name, _MISSING)
        except TypeError:  # an unhashable name
            entry = _MISSING
        if entry is not _MISSING:
            return entry
        if default is not _MISSING:
            return default
        more = f" ({self.hint})" if self.hint else ""
        raise UnknownNameError(f"unknown {self.what} {shown(name)}; known: {', '.join(map(str, self.names()))}"
                               f"{more}") from None

    def trait(self, name: Any, trait: str) -> Any:
        """What entry ``name`` declared for ``trait``, else the registry's default for it (an unknown
        name or trait raises)."""
        self.get(name)
        self._check_traits(name, {trait: None})
        return self._traits.get(name, {}).get(trait, self._defaults[trait])

    def names(self) -> list[Any]:
        return list(self._entries) if self.ordered else sorted(self._entries)

    def values(self) -> list[T]:
        """The entries, in the order of ``names()`` (a snapshot: registering meanwhile cannot disturb it)."""
        if self.ordered:
            return list(self._entries.values())
        return [self._entries[name] for name in sorted(self._entries)]

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:
            return False

    def __iter__(self) -> Iterator[Any]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(map(str, self.names()))})"
