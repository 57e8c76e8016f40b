"""Sandboxes for the commands a try runs (issue 55, first part): one small protocol (``Sandbox``: run a command, put
and get files, alive, close) and its backends on one registry: ``bwrap`` (bubblewrap namespaces, the default) and
``local`` (no isolation, by name). docs/sandboxes.md says what a try can and cannot reach."""

from .backends import (SANDBOX_BACKENDS, BwrapSandbox, LocalSandbox, bwrap_available, open_sandbox, overlay_available,
                       register_sandbox_backend)
from .base import ENDINGS, Limits, RunResult, Sandbox, SandboxError
from .layers import Snapshot

__all__ = ["ENDINGS", "SANDBOX_BACKENDS", "BwrapSandbox", "Limits", "LocalSandbox", "RunResult", "Sandbox",
           "SandboxError", "Snapshot", "bwrap_available", "open_sandbox", "overlay_available",
           "register_sandbox_backend"]
