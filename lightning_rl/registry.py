"""One registry type behind every named extension point (credit assigners, advantage estimators, policy
losses, reward helpers, weight publishers, experiment trackers).

As verl's ``core_algos.py`` does it: a plain mapping filled by a decorator that returns the function
unchanged, so every registered function stays directly callable and testable. Two rules everywhere:

* a name is registered once; registering it again is refused (:class:`~lightning_rl.errors.ConfigurationError`
  naming what holds it), so one plugin cannot silently replace another's function;
* an unknown name fails listing the known ones (:class:`~lightning_rl.errors.UnknownNameError`).

::

    CREDIT = Registry("credit assignment", hint="register one with @lightning_rl.register_credit")

    @CREDIT.register("final")
    def final_credit(n, final, steps): ...

    CREDIT.get("final") is final_credit
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import ConfigurationError, UnknownNameError, shown

T = TypeVar("T")


def _where(obj: object) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if module and name else shown(obj)


class Registry(Generic[T]):
    """Names to functions (or factories) of one kind. ``what`` names the kind in messages; ``hint`` says
    how to add one."""

    def __init__(self, what: str, *, hint: str = "") -> None:
        self.what = what
        self.hint = hint
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator: ``@registry.register("name")`` records the function and returns it unchanged."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a {self.what} is registered under a non-empty string name, got {shown(name)}")

        def add(obj: T) -> T:
            self.add(name, obj)
            return obj

        return add

    def add(self, name: str, obj: T) -> None:
        """Record ``obj`` under ``name`` (what ``register`` does, without the decorator)."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a {self.what} is registered under a non-empty string name, got {shown(name)}")
        if not callable(obj):
            raise ConfigurationError(f"a {self.what} must be callable, got {shown(obj)} for {name!r}")
        held = self._entries.get(name)
        if held is not None:
            raise ConfigurationError(f"a {self.what} named {name!r} is registered already ({_where(held)}); "
                                     f"register {_where(obj)} under another name")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """The function registered as ``name``; an unknown name raises, listing the known ones."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            more = f" ({self.hint})" if self.hint else ""
            raise UnknownNameError(f"unknown {self.what} {shown(name)}; known: {', '.join(sorted(self._entries))}"
                                   f"{more}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(sorted(self._entries))})"
