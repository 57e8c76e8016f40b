"""Agents named by reference: ``module:qualname`` of a traced function (``agent_reference``), imported back
by a worker process, a CLI command or a verl agent loop (``load_agent``). ``runner.py`` re-exports both from
their old path."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigurationError


def agent_reference(agent: Callable[[Any], Any]) -> str:
    """``module:qualname`` of a module-level traced function, importable by a worker process."""
    module, name = getattr(agent, "__module__", None), getattr(agent, "__qualname__", "")
    if not module or "<locals>" in name or module == "__main__":
        raise ConfigurationError(
            f"worker processes import the agent by name, but {agent!r} is not importable "
            f"(module {module!r}, name {name!r}); define it at module level in an importable module"
        )
    return f"{module}:{name}"


def load_agent(reference: str) -> Callable[[Any], Any]:
    """Import ``module:function`` (the current directory is searched too, as ``python -m`` does)."""
    module, _, name = reference.partition(":")
    if not module or not name:
        raise ConfigurationError(f"agent {reference!r} is not module:function (e.g. my_pkg.agents:solve)")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load agent {reference!r}: {exc}; give an importable module:function") from None
    if not callable(obj):
        raise ConfigurationError(f"agent {reference!r} is a {type(obj).__name__}, not a function")
    return obj
