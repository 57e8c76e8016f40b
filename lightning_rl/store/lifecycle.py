"""Open stores are closed at interpreter exit (queued records are written) and re-opened in a
forked child (a child gets no copy of the parent's writer thread or connections), except in a child
that only sets itself up and execs (``forks.exec_after_fork``)."""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

from ..diagnostics import report_failure
from ..forks import child_execs

_open: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(store: Any) -> None:
    """Close ``store`` at exit; call its ``_after_fork()`` in forked children while it is open."""
    _open.add(store)


def _close_all() -> None:
    for store in list(_open):
        try:
            store.close()
        except Exception as exc:
            report_failure("close at exit", exc)


def _reinit_after_fork() -> None:
    if child_execs():  # a child about to exec: nothing of the parent's stores is used in it
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
