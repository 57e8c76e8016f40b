"""Which collections of Python's cyclic garbage collector start while one method runs (issue 57: reading a whole answer
must set none off)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def collections_inside(monkeypatch: Any, owner: type, name: str) -> Iterator[list[int]]:
    """The generations of the collections that start while ``owner.name`` runs, on any thread, with the threshold at
    50 new containers (thousands of chances in a long answer); the threshold and callbacks are restored after."""
    original = getattr(owner, name)
    inside, started = [False], []

    def watched(*args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            inside[0] = False

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and inside[0]:
            started.append(info["generation"])

    monkeypatch.setattr(owner, name, watched)
    threshold = gc.get_threshold()
    gc.set_threshold(50)
    gc.callbacks.append(watch)
    try:
        yield started
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
