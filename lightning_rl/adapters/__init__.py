"""Framework adapters. Each emits spans through the tracer only.

Optional frameworks are imported only inside their own adapter module, and only once the user's
program has imported them: ``install()`` instruments the frameworks already loaded and puts a
post-import hook on ``sys.meta_path`` for the others, so a framework is instrumented the moment its
import finishes, wherever that happens (at the top of a module, or inside the first traced call).
The order of imports never matters, and a program that never imports LangChain or AutoGen never
pays for them.

Which frameworks: :data:`FRAMEWORKS`, a :class:`~lightning_rl.registry.Registry` from the module whose
import says a framework is in use (``"langchain_core"``, ``"google.adk"``) to its adapter's
``instrument``. The contract of ``instrument() -> bool``:

* it is called once per process, after the framework's import finished (or at ``install()``, or at
  registration, when the framework is loaded already), never before and never for a framework the
  program does not import;
* it returns True when it instrumented the framework, False when the framework is absent or a version it
  does not support (a module of that name that is not the framework); ``instrumented()`` reports both;
* it may raise: the hook never lets that reach the user's import. A failure is logged once, counted
  (``lightning_rl.stats()``: ``instrumenting <framework>``) and the program goes on uninstrumented.

A third party adds a framework the same way ours are (``docs/extending.md``)::

    from lightning_rl.adapters import register_framework

    @register_framework("toyframework")
    def instrument() -> bool:
        import toyframework                       # imported already: this runs after its import
        toyframework.Agent.run = wrap(toyframework.Agent.run)
        return True

or, to import the adapter module itself only once the framework is imported,
``FRAMEWORKS.add("toyframework", lazy("toy_adapter:instrument"))``; such a module ends with
``module_ready(__name__)``, as ours do (a program may import the adapter module before its framework).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..diagnostics import report_failure
from ..errors import ConfigurationError, shown
from ..registry import Registry


class lazy:  # noqa: N801  (used like a function: FRAMEWORKS.add(name, lazy("module:function")))
    """An adapter's ``instrument`` named ``"module:function"``: the module is imported when it is called."""

    __slots__ = ("module", "function")

    def __init__(self, target: str) -> None:
        module, _, function = target.partition(":") if isinstance(target, str) else ("", "", "")
        if not module or not function or not all(part.isidentifier() for part in (*module.split("."), function)):
            raise ConfigurationError(
                f"a lazy framework adapter is named 'package.module:function', got {shown(target)}")
        self.module, self.function = module, function

    def __call__(self) -> Any:
        return getattr(importlib.import_module(self.module), self.function)()

    def __repr__(self) -> str:
        return f"lazy('{self.module}:{self.function}')"


class _Frameworks(Registry[Callable[[], bool]]):
    """The registry; a framework registered once ``install()`` ran and already imported is instrumented now."""

    def add(self, name: str, obj: Callable[[], bool], **traits: Any) -> None:
        super().add(name, obj, **traits)
        if _installed and name in sys.modules:
            _instrument(name)


_installed = False  # install() ran
FRAMEWORKS = _Frameworks(  # ordered: frameworks loaded already are instrumented in the order they were registered
    "framework adapter", ordered=True,
    hint="register one with @lightning_rl.adapters.register_framework(module) (docs/extending.md)")
register_framework = FRAMEWORKS.register

# the module that signals a framework is in use -> its adapter, imported only once that module is
for _framework, _target in {
    "langchain_core": "lightning_rl.adapters.langchain:instrument_framework",
    "autogen_agentchat": "lightning_rl.adapters.autogen:instrument",
    "agents": "lightning_rl.adapters.openai_agents:instrument",  # the OpenAI Agents SDK (openai-agents)
    "pydantic_ai": "lightning_rl.adapters.pydanticai:instrument",
    "smolagents": "lightning_rl.adapters.smolagents:instrument",
    "crewai": "lightning_rl.adapters.crewai:instrument",
    "llama_index.core": "lightning_rl.adapters.llamaindex:instrument",  # llama_index is a namespace package
    "google.adk": "lightning_rl.adapters.google_adk:instrument",  # Google ADK (google is a namespace package)
    "mcp": "lightning_rl.adapters.mcp:instrument",  # the MCP SDK's client sessions: tool calls (mcp.py)
    # HTTP clients: LLM calls that bypass the instrumented OpenAI client are seen there (http_clients.py)
    "httpx": "lightning_rl.adapters.http_clients:instrument_httpx",
    "httpx2": "lightning_rl.adapters.http_clients:instrument_httpx2",
    "requests": "lightning_rl.adapters.http_clients:instrument_requests",
    "aiohttp": "lightning_rl.adapters.http_clients:instrument_aiohttp",
}.items():
    FRAMEWORKS.add(_framework, lazy(_target))

_done: set[str] = set()
_instrumented: dict[str, bool] = {}  # framework -> what its instrument() answered
_lock = threading.RLock()
# adapter module -> frameworks whose import finished inside that module's own import (``import
# lightning_rl.adapters.langchain`` before LangChain): instrumented when the adapter module is done (module_ready)
_pending: dict[str, list[str]] = {}


def _instrument(framework: str, *, ready: bool = False) -> None:
    """Instrument one framework once (never raises: a failure is logged once and counted)."""
    with _lock:
        if framework in _done:
            return
        _done.add(framework)
    entry = FRAMEWORKS.get(framework)
    if isinstance(entry, lazy):
        loaded = sys.modules.get(entry.module)
        if not ready and loaded is not None and getattr(getattr(loaded, "__spec__", None), "_initializing", False):
            with _lock:  # the adapter is half-initialised: its last line (module_ready) instruments the framework
                _pending.setdefault(entry.module, []).append(framework)
            return
    try:
        answer = entry()
    except Exception as exc:
        report_failure(f"instrumenting {framework}", exc)
        return
    if not isinstance(answer, bool):
        where = entry if isinstance(entry, lazy) else f"{entry.__module__}.{getattr(entry, '__qualname__', '?')}"
        report_failure(f"instrumenting {framework}", message=(
            f"lightning-rl: the adapter of {framework!r} ({where}) returned {shown(answer)}, not True or False; "
            "an adapter's instrument() -> bool says whether it instrumented (counted, logged once)"))
        return
    _instrumented[framework] = answer


def instrumented() -> dict[str, bool]:
    """The frameworks whose adapter ran: True where it instrumented, False where it found the framework absent
    or unsupported (a failure is neither: it is counted in ``lightning_rl.stats()``)."""
    return dict(_instrumented)


def module_ready(module: str) -> None:
    """The last line of every adapter module: instruments the frameworks whose import finished while the
    adapter module itself was being imported (it imports its framework at its top)."""
    with _lock:
        frameworks = _pending.pop(module, [])
        _done.difference_update(frameworks)
    for framework in frameworks:
        _instrument(framework, ready=True)


def instrument_loaded() -> None:
    """Instrument every supported framework that is already in ``sys.modules``."""
    for framework in FRAMEWORKS.names():
        if framework not in _done and framework in sys.modules:
            _instrument(framework)


class _InstrumentAfterExec(importlib.abc.Loader):
    """Runs the framework's own loader, then instruments it. Everything else is the original loader's."""

    def __init__(self, loader: Any, framework: str) -> None:
        self._loader = loader
        self._framework = framework

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module is the framework's: it keeps its own loader, as if we were never there.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _instrument(self._framework)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_code, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a framework's top-level package it asks the finders after it and
    wraps the loader they return, so that the framework is instrumented when its import finishes."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in FRAMEWORKS or fullname in _done or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        except Exception as exc:  # never break the user's import: let the normal machinery try
            report_failure("post-import hook", exc)
            return None
        finally:
            self._busy.on = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _InstrumentAfterExec(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def install() -> None:
    """Instrument the frameworks already imported and hook the imports of the others (idempotent)."""
    global _installed
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        _installed = True
    instrument_loaded()
