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
