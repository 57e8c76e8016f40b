"""Sandboxes for the commands a try runs (issue 55): one small protocol (``Sandbox``: run a command, put and get
files and folders, restore, reset, alive, close) and its backends on one registry: ``bwrap`` (bubblewrap namespaces,
the default) and ``local`` (no isolation, by name), ``docker`` and ``podman`` (``container.py``); snapshots a task is prepared in once, with copy-on-write views
for its tries (``layers.py``); pools of them (``pool.py``); and the try's sandbox in a rollout, ``lrl.sandbox()``
(``tries.py``: this module is callable). docs/sandboxes.md says what a try can and cannot reach."""

import sys as _sys
import types as _types

from . import tries as _tries
from .backends import (SANDBOX_BACKENDS, BwrapSandbox, LocalSandbox, bwrap_available, open_sandbox, overlay_available,
                       register_sandbox_backend)
from .base import ENDINGS, Limits, RunResult, Sandbox, SandboxError
from .container import ContainerSandbox, PodmanSandbox, container_available
from .layers import Snapshot
from .pool import SANDBOX_METRICS, SandboxPool
from .tries import TracedSandbox, current_sandbox, sandboxes

__all__ = ["ENDINGS", "SANDBOX_BACKENDS", "SANDBOX_METRICS", "BwrapSandbox", "ContainerSandbox", "Limits", "LocalSandbox", "PodmanSandbox",
           "RunResult", "Sandbox", "SandboxError", "SandboxPool", "Snapshot", "TracedSandbox", "bwrap_available",
           "container_available", "current_sandbox",
           "open_sandbox", "overlay_available", "register_sandbox_backend", "sandboxes"]


class _CallableModule(_types.ModuleType):
    """``lrl.sandbox()`` is the try's sandbox (``tries.sandbox``); ``lrl.sandbox.Snapshot`` and the rest are this
    package's names."""

    def __call__(self) -> TracedSandbox:
        return _tries.sandbox()


_sys.modules[__name__].__class__ = _CallableModule
