"""Agents imported by runner processes in the store-server tests (module:function references)."""

from __future__ import annotations

import os
import time

import lightning_rl as lrl


@lrl.trace
def add(task: dict) -> float:
    with lrl.tool_span("add", arguments=task) as span:
        result = task["a"] + task["b"]
        span.result = result
    return 1.0 if result == task["a"] + task["b"] else 0.0


@lrl.trace
def steps(task: dict) -> float:
    """``task["spans"]`` tool spans, ``task["sleep"]`` seconds apart (reliability tests); with ``task["until"]`` (a
    file), the try then waits until that file exists (at most two minutes): a test holds tries in flight so."""
    for i in range(task.get("spans", 10)):
        with lrl.tool_span("step", arguments={"i": i, "pad": "x" * task.get("pad", 0)}):
            pass
        if task.get("sleep"):
            time.sleep(task["sleep"])
    deadline = time.monotonic() + 120
    while task.get("until") and not os.path.exists(task["until"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return float(task.get("reward", 1.0))


def pid() -> int:
    return os.getpid()
