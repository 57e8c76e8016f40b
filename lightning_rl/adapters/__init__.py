"""Framework adapters. Each emits spans through the tracer only.

Optional frameworks are imported only inside their own adapter module, and only once the user's
program has imported them: ``install()`` instruments the frameworks already loaded and puts a
post-import hook on ``sys.meta_path`` for the others, so a framework is instrumented the moment its
import finishes, wherever that happens (at the top of a module, or inside the first traced call).
The order of imports never matters, and a program that never imports LangChain or AutoGen never
pays for them.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Any

from ..diagnostics import report_failure

# framework module that signals it is in use -> "adapter module:function" that instruments it
_FRAMEWORKS = {
    "langchain_core": "lightning_rl.adapters.langchain:instrument",
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
}
_done: set[str] = set()
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
    module, _, function = _FRAMEWORKS[framework].partition(":")
    loaded = sys.modules.get(module)
    if not ready and loaded is not None and getattr(getattr(loaded, "__spec__", None), "_initializing", False):
        with _lock:  # the adapter is half-initialised: its last line (module_ready) instruments the framework
            _pending.setdefault(module, []).append(framework)
        return
    try:
        getattr(__import__(module, fromlist=[function or "instrument"]), function or "instrument")()
    except Exception as exc:
        report_failure(f"instrumenting {framework}", exc)


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
    for framework in _FRAMEWORKS:
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
        if fullname not in _FRAMEWORKS or fullname in _done or getattr(self._busy, "on", False):
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
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    instrument_loaded()
