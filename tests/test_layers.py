"""Imports point one way (DESIGN.md, "Layers"): read every module's imports with ``ast``.

bottom (records, errors, semconv, settings, diagnostics, boundaries, registry, serving, sink, forks) <- tracer <- capture <- adapters;
bottom <- store; tracer, capture and store <- gateway; the gateway and the adapters both stand on capture (the exchange
record, the dialects) and never import each other; store and trainer_bridge <- viewer; the face (``__init__``, ``_api``, ``cli``) and ``trainer_bridge`` wire them together. Imports inside
functions count too: a lazy import still runs against the flow.

Inside the store (a kit, docs/extending.md): a backend is its folder or its module (``STORE_BACKENDS``); a module
kept at its path from before the folders (it puts the moved module in ``sys.modules`` in its place) is the
backend's it imports. No backend imports another, and the rest of the store (the kit, the protocols, the shared
machinery) imports none: only the store's own ``__init__`` imports them all, which registers their URL schemes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_rl"
BOTTOM = {"records", "errors", "semconv", "settings", "diagnostics", "boundaries", "registry", "serving", "sink", "forks"}
FACE = {"lightning_rl", "_api", "cli"}
# layer -> the layers it must never import
FORBIDDEN = {
    "bottom": {"tracer", "capture", "store", "adapters", "trainer_bridge", "face", "vllm_server", "gateway", "viewer",
               "rewards", "judge"},
    "tracer": {"capture", "store", "adapters", "trainer_bridge", "face", "gateway", "viewer", "rewards", "judge",
               "sandbox"},
    "capture": {"store", "adapters", "trainer_bridge", "face", "gateway", "viewer", "rewards", "judge"},
    "store": {"tracer", "capture", "adapters", "trainer_bridge", "face", "gateway", "viewer", "rewards", "judge"},
    "adapters": {"store", "trainer_bridge", "face", "gateway", "viewer", "rewards", "judge"},
    "gateway": {"adapters", "trainer_bridge", "face", "viewer"},  # the tracer and the capture core behind HTTP
    "viewer": {"tracer", "capture", "adapters", "gateway", "face"},  # reads the store; the trainer's advantage function
    "trainer_bridge": {"viewer"},
    "rewards": {"capture", "store", "adapters", "trainer_bridge", "face", "gateway", "viewer"},  # helpers over the tracer
    "judge": {"tracer", "capture", "adapters", "trainer_bridge", "face", "gateway", "viewer", "rewards"},  # HTTP, over a store
    # runs commands in isolation; of rollouts it knows only the tracer's (lrl.sandbox(): the try's sandbox, its
    # commands as tool spans, in tries.py); runners and the gateway's commands use it, never the other way
    "sandbox": {"capture", "store", "adapters", "trainer_bridge", "face", "gateway", "viewer", "rewards", "judge"},
}


STORE_BACKENDS = {"sqlite", "postgres", "http", "memory_store"}


def layer_of(dotted: str) -> str:
    """``lightning_rl.store.base`` -> ``store``; ``lightning_rl.records`` -> ``bottom``."""
    parts = dotted.split(".")
    assert parts[0] == "lightning_rl", dotted
    if len(parts) == 1 or parts[1] in FACE or parts[1] == "__init__":
        return "face"
    return "bottom" if parts[1] in BOTTOM else parts[1]


def imported_modules(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Every ``lightning_rl`` module that ``module``'s source imports, anywhere in the file."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "lightning_rl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "lightning_rl":
                continue
            if node.module is None or target in ("lightning_rl",):  # `from .. import semconv`: submodules
                found.update(f"{target}.{a.name}" for a in node.names)
            else:
                found.add(target)
    return found


def violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    own = layer_of(module)
    banned = FORBIDDEN.get(own, set())
    return sorted(f"{module} ({own}) imports {target} ({layer_of(target)})"
                  for target in imported_modules(source, module, is_package=is_package)
                  if layer_of(target) in banned and layer_of(target) != own)


def store_backend_of(dotted: str) -> str | None:
    """``lightning_rl.store.postgres.sql`` -> ``postgres``; a module outside every backend -> None."""
    parts = dotted.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "store" and parts[2] in STORE_BACKENDS else None


def store_violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The store's own rule (module doc): which backends ``module`` may import."""
    if layer_of(module) != "store" or module == "lightning_rl.store":
        return []
    targets = {t for t in imported_modules(source, module, is_package=is_package) if layer_of(t) == "store"}
    own = store_backend_of(module)
    if own is None and "sys.modules[__name__] =" in source:  # a kept path: the backend of the module it is
        own = next((b for b in map(store_backend_of, targets) if b is not None), None)
    return sorted(f"{module} (store: {own or 'shared'}) imports {target} (store: {store_backend_of(target)})"
                  for target in targets if store_backend_of(target) not in (None, own))


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        is_package = rel.name == "__init__"
        dotted = ".".join(rel.parts[:-1] if is_package else rel.parts)
        yield dotted, path, is_package


def test_no_import_runs_against_the_flow():
    found = [v for dotted, path, is_package in _modules()
             for v in violations(path.read_text(), dotted, is_package=is_package)]
    assert found == []


def test_no_store_backend_imports_another_and_the_shared_store_imports_none():
    found = [v for dotted, path, is_package in _modules()
             for v in store_violations(path.read_text(), dotted, is_package=is_package)]
    assert found == []


@pytest.mark.parametrize("source,module,expected", [
    ("from ..sqlite.store import SQLiteStore", "lightning_rl.store.postgres.store", ["sqlite"]),
    ("def f():\n    from ..postgres import sql", "lightning_rl.store.kit.backends", ["postgres"]),
    ("from .memory_store import InMemoryStore", "lightning_rl.store.queries", ["memory_store"]),
    ("from .. import checks, wire\nfrom . import reads", "lightning_rl.store.sqlite.store", []),
    ("import sys\nfrom .http import server as _moved\nsys.modules[__name__] = _moved", "lightning_rl.store.server", []),
    ("from .http import server", "lightning_rl.store.server", ["http"]),
])
def test_the_store_rule_catches_a_backend_import(source, module, expected):
    got = store_violations(source, module)
    assert [v.rsplit("(store: ", 1)[1].rstrip(")") for v in got] == expected


def test_every_package_module_is_in_a_known_layer():
    layers = {layer_of(dotted) for dotted, _, _ in _modules()}
    assert layers <= {"bottom", "face", "tracer", "capture", "store", "adapters", "trainer_bridge", "vllm_server", "gateway",
                      "viewer", "rewards", "judge", "sandbox"}
    assert {"bottom", "tracer", "capture", "store", "adapters", "gateway"} <= layers


@pytest.mark.parametrize("source,module,is_package,expected", [
    ("from ..tracer.diagnostics import count", "lightning_rl.store.rows", False, ["tracer"]),
    ("def f():\n    from ..adapters import openai", "lightning_rl.store.base", False, ["adapters"]),
    ("import lightning_rl.store.base", "lightning_rl.tracer.context", False, ["store"]),
    ("from .. import _api", "lightning_rl.adapters.openai", False, ["face"]),
    ("from .tracer import tracing", "lightning_rl.records", False, ["tracer"]),
    ("from ..store import Store", "lightning_rl.tracer", True, ["store"]),
    ("from ..records import SpanRow\nfrom .. import semconv", "lightning_rl.store.rows", False, []),
    ("from .. import wire", "lightning_rl.store.http.server", False, []),
    ("from ..adapters.openai import instrument", "lightning_rl.gateway.forwarding", False, ["adapters"]),
    ("from ...adapters import http_clients", "lightning_rl.capture.dialects.chat", False, ["adapters"]),
    ("def f():\n    from ..gateway import proxy", "lightning_rl.capture.exchange", False, ["gateway"]),
    ("from ..capture import CapturedCall\nfrom ..capture.dialects import DIALECTS", "lightning_rl.gateway.forwarding",
     False, []),
    ("from ..capture import Server", "lightning_rl.adapters.openai", False, []),
    ("from .. import capture", "lightning_rl.tracer.provider", False, ["capture"]),
])
def test_the_checker_catches_each_kind_of_import(source, module, is_package, expected):
    got = violations(source, module, is_package=is_package)
    assert [v.rsplit("(", 1)[1].rstrip(")") for v in got] == expected
