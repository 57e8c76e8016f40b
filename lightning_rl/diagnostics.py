"""Failure accounting for code that must never raise into the user's agent.

A failure is logged once per cause (with its traceback) and counted every time; ``counters()``
feeds ``lightning_rl.stats()`` and ``lightning-rl doctor``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("lightning_rl")

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_logged: set[str] = set()


def report_failure(cause: str, exc: BaseException | None = None, message: str = "") -> None:
    """Count a failure; log it the first time this cause is seen."""
    with _lock:
        _counts[cause] += 1
        first = cause not in _logged
        _logged.add(cause)
    if first:
        text = message or f"lightning-rl: {cause} failed; the agent continues (logged once per cause)"
        logger.warning(text, exc_info=exc)


def count(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def counters() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def reset() -> None:
    """Forget counts and logged causes (tests)."""
    with _lock:
        _counts.clear()
        _logged.clear()
