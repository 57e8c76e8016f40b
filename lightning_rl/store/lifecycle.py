"""Open stores are closed at interpreter exit (queued records are written) and re-opened in a
forked child (a child gets no copy of the parent's writer thread or connections), except in a child
that only sets itself up and execs (``exec_after_fork``)."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from ..diagnostics import report_failure

_open: "weakref.WeakSet[Any]" = weakref.WeakSet()
_forking = threading.local()  # the thread that forks is the child's one thread: what it set, the child sees


def track(store: Any) -> None:
    """Close ``store`` at exit; call its ``_after_fork()`` in forked children while it is open."""
    _open.add(store)


def _close_all() -> None:
    for store in list(_open):
        try:
            store.close()
        except Exception as exc:
            report_failure("close at exit", exc)


@contextlib.contextmanager
def exec_after_fork() -> Iterator[None]:
    """Around a ``Popen`` with ``preexec_fn`` in this thread: its child execs right after its set-up, so the stores
    are not re-opened in it. Python runs the after-fork hooks in such a child, and re-opening a store there opened
    SQLite connections between fork and exec: when another thread of the parent held SQLite's allocator mutex at the
    fork, the child waited on it forever (a sandbox command that never started, its ``Popen`` waiting for the exec;
    seen under load with a runner's tries in sandboxes)."""
    _forking.execs = getattr(_forking, "execs", 0) + 1
    try:
        yield
    finally:
        _forking.execs -= 1


def _reinit_after_fork() -> None:
    if getattr(_forking, "execs", 0):  # a child about to exec: nothing of the parent's stores is used in it
        return
    for store in list(_open):
        if not store._closed:
            try:
                store._after_fork()
            except Exception as exc:
                report_failure("store re-open after fork", exc)


atexit.register(_close_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)
