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
    """``task["spans"]`` tool spans, ``task["sleep"]`` seconds apart (reliability tests)."""
    for i in range(task.get("spans", 10)):
        with lrl.tool_span("step", arguments={"i": i, "pad": "x" * task.get("pad", 0)}):
            pass
        if task.get("sleep"):
            time.sleep(task["sleep"])
    return float(task.get("reward", 1.0))


def pid() -> int:
    return os.getpid()
