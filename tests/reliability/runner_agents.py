"""Module-level agents for the runner fault tests (importable by worker processes)."""

from __future__ import annotations

import asyncio
import threading
import time

import lightning_rl as lrl

release = threading.Event()  # set by a test to let hung agents finish


@lrl.trace
def slow_sync_agent(task):
    """A sync agent that takes ``task["seconds"]`` (a slow tool, a blocking client)."""
    time.sleep(task["seconds"])
    return 1.0


@lrl.trace
def hung_sync_agent(task):
    """A sync agent that hangs until the test releases it (a tool that never answers)."""
    release.wait(120)
    return 1.0


_pool = asyncio.Event()  # like a client's connection pool: bound to the first event loop that waits on it


@lrl.trace
async def loop_bound_agent(task):
    try:
        await asyncio.wait_for(_pool.wait(), 0.01)
    except TimeoutError:
        pass
    return 1.0


@lrl.trace
async def loop_bound_eval_agent(task):
    return await loop_bound_agent(task)


@lrl.trace
def long_tail(task):
    """A sync agent with ``task["tools"]`` tool calls whose latencies have a long tail (0.1-5 s, lognormal,
    median about 0.6 s), like web calls and containers do. Seeded by the task: reproducible."""
    import random

    rng = random.Random(task["seed"])
    for i in range(task["tools"]):
        with lrl.tool_span("slow_tool", arguments={"i": i}) as tool:
            time.sleep(min(5.0, max(0.1, rng.lognormvariate(-0.5, 0.9))))
            tool.result = str(i)
    return 1.0
