"""What a forked child of this process does with the parent's open resources.

A plain fork re-opens what it inherits (the stores register their after-fork hooks in ``store/lifecycle.py``). A
``Popen`` with a ``preexec_fn`` forks too, and Python runs the same hooks in its child, between fork and exec; such a
child only sets itself up and execs, so nothing is re-opened in it. The code that starts one (the sandbox's commands,
the gateway's sandboxed launch) marks it with :func:`exec_after_fork`; the hooks ask :func:`child_execs`. At the
bottom of the layers: the sandbox may not import the store, and both need this.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_forking = threading.local()  # the thread that forks is the child's one thread: what it set, the child sees


@contextlib.contextmanager
def exec_after_fork() -> Iterator[None]:
    """Around a ``Popen`` with ``preexec_fn`` in this thread: its child execs right after its set-up, so the stores
    are not re-opened in it. Re-opening a store there opened SQLite connections between fork and exec: when another
    thread of the parent held SQLite's allocator mutex at the fork, the child waited on it forever (a sandbox command
    that never started, its ``Popen`` waiting for the exec; seen under load with a runner's tries in sandboxes)."""
    _forking.execs = getattr(_forking, "execs", 0) + 1
    try:
        yield
    finally:
        _forking.execs -= 1


def child_execs() -> bool:
    """True in the child of a fork made inside :func:`exec_after_fork` (and in the thread that makes it)."""
    return bool(getattr(_forking, "execs", 0))
