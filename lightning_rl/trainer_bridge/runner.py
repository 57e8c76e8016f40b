"""Runners: lease tasks from the store's queue and execute the traced agent on them.

A runner leases up to ``concurrency`` entries, runs each under ``rollout_overrides`` (the entry's
rollout id, group, attempt, mode and task, and the per-rollout ``timeout``), heartbeats while the
rollout runs, and completes the entry with the rollout's outcome. An exception (a failed model
call included) makes the outcome ``failed``, a timeout ``timed_out``: never a success. A runner
that dies stops heartbeating; its lease expires and the task is retried by another runner.

Async agents run as asyncio tasks on the runner's one event loop. Sync agents run in threads with
a copied context, or in worker processes (``run_in_processes``: each imports the agent by
``module:function`` and leases from the same SQLite store file).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..diagnostics import report_failure
from ..errors import LightningRLError
from ..records import QueueEntry, RolloutStatus
from ..store.base import Store
from ..tracer import rollout_overrides


class Runner:
    def __init__(self, store: Store, agent: Callable[[Any], Any], *, runner_id: str | None = None,
                 concurrency: int = 8, lease_seconds: float = 60.0, rollout_timeout: float | None = 120.0,
                 poll: float = 0.05) -> None:
        self.store = store
        self.agent = agent
        self.runner_id = runner_id or f"runner-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.rollout_timeout = rollout_timeout
        self.poll = poll
        self.is_async = inspect.iscoroutinefunction(agent)
        self._aio: asyncio.Runner | None = None
        self._stopping = False
        self._last_busy = time.monotonic()

    def run_until_done(self, group_ids: Sequence[str], *, on_done: Callable[[QueueEntry, str], None] | None = None) -> None:
        """Lease and run tries until every try of ``group_ids`` is done.

        Every call runs on the runner's one event loop: async clients (AsyncOpenAI's connection
        pool) are bound to the loop they first ran on, and a new loop per call breaks them
        ("Event loop is closed")."""
        groups = list(group_ids)

        async def groups_done() -> bool:  # others' leases may still expire and come back
            return await asyncio.to_thread(self.store.wait_for_groups, groups, timeout=0)

        self._run(self._drive(groups_done, on_done=on_done))

    def serve(self, *, idle_exit: float | None = None, max_rollouts: int | None = None) -> int:
        """Lease and run tries from the whole queue until stopped (SIGTERM/SIGINT), idle for
        ``idle_exit`` seconds, or ``max_rollouts`` done. Returns how many tries it ran. A store that
        stops answering (a server restart) is waited out: the loop retries, it does not die."""

        async def idle_long_enough() -> bool:
            return idle_exit is not None and time.monotonic() - self._last_busy >= idle_exit

        return self._run(self._drive(idle_long_enough, max_rollouts=max_rollouts))

    def stop(self) -> None:
        """Lease nothing more; the tries in hand finish, then ``serve`` returns."""
        self._stopping = True

    def _run(self, coro: Any) -> Any:
        if self._aio is None:
            self._aio = asyncio.Runner()
        return self._aio.run(coro)

    async def _drive(self, idle_done: Callable[[], Any], *, max_rollouts: int | None = None,
                     on_done: Callable[[QueueEntry, str], None] | None = None) -> int:
        """The one lease-and-run loop. When nothing runs, ``await idle_done()`` True ends it.
        Returns how many tries ran."""
        running: set[asyncio.Task] = set()
        ran = 0
        self._stopping = False
        self._last_busy = time.monotonic()
        while True:
            free = self.concurrency - len(running)
            if max_rollouts is not None:
                free = min(free, max_rollouts - ran - len(running))
            if free > 0 and not self._stopping:
                for entry in await self._lease(free):
                    running.add(asyncio.create_task(self._run_one(entry, on_done)))
            if running:
                self._last_busy = time.monotonic()
                done, pending = await asyncio.wait(running, timeout=self.poll, return_when=asyncio.FIRST_COMPLETED)
                running = set(pending)
                ran += len(done)
                for task in done:
                    if task.exception() is not None:
                        report_failure("runner task", task.exception())
                continue
            if self._stopping or (max_rollouts is not None and ran >= max_rollouts) or await idle_done():
                return ran
            await asyncio.sleep(self.poll)

    async def _lease(self, limit: int) -> list[QueueEntry]:
        try:
            return await asyncio.to_thread(self.store.lease, self.runner_id, lease_seconds=self.lease_seconds,
                                           limit=limit)
        except LightningRLError as exc:  # the store is away (a server restart): wait, then try again
            report_failure("runner lease", exc)
            await asyncio.sleep(1.0)
            return []

    def close(self) -> None:
        if self._aio is not None:
            self._aio.close()
            self._aio = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _heartbeat(self, entry: QueueEntry) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await asyncio.to_thread(self.store.heartbeat, entry.queue_id, self.runner_id,
                                        lease_seconds=self.lease_seconds)
            except LightningRLError as exc:  # the store is away; keep beating, the lease may survive
                report_failure("runner heartbeat", exc)

    async def _run_one(self, entry: QueueEntry, on_done) -> None:
        beat = asyncio.create_task(self._heartbeat(entry))
        outcome = RolloutStatus.SUCCEEDED
        overrides = dict(rollout_id=entry.rollout_id, group_id=entry.group_id, attempt=entry.attempt,
                         mode=entry.mode.value, task=entry.task, timeout=self.rollout_timeout)
        try:
            with rollout_overrides(**overrides):
                if self.is_async:
                    await self.agent(entry.task)
                else:
                    ctx = contextvars.copy_context()
                    await asyncio.to_thread(ctx.run, self.agent, entry.task)
        except (TimeoutError, asyncio.TimeoutError):
            outcome = RolloutStatus.TIMED_OUT
        except Exception:
            outcome = RolloutStatus.FAILED  # recorded on the rollout by @trace; never a success
        finally:
            beat.cancel()
        await asyncio.to_thread(self.store.complete, entry.queue_id, self.runner_id, outcome)
        if on_done is not None:
            on_done(entry, outcome.value)


def agent_reference(agent: Callable[[Any], Any]) -> str:
    """``module:qualname`` of a module-level traced function, importable by a worker process."""
    module, name = getattr(agent, "__module__", None), getattr(agent, "__qualname__", "")
    if not module or "<locals>" in name or module == "__main__":
        from ..errors import ConfigurationError

        raise ConfigurationError(
            f"worker processes import the agent by name, but {agent!r} is not importable "
            f"(module {module!r}, name {name!r}); define it at module level in an importable module"
        )
    return f"{module}:{name}"


def load_agent(reference: str) -> Callable[[Any], Any]:
    """Import ``module:function`` (the current directory is searched too, as ``python -m`` does)."""
    import importlib
    import sys

    from ..errors import ConfigurationError

    module, _, name = reference.partition(":")
    if not module or not name:
        raise ConfigurationError(f"agent {reference!r} is not module:function (e.g. my_pkg.agents:solve)")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load agent {reference!r}: {exc}; give an importable module:function") from None
    if not callable(obj):
        raise ConfigurationError(f"agent {reference!r} is a {type(obj).__name__}, not a function")
    return obj


def _process_worker(store_url: str, reference: str, group_ids: list[str], runner_id: str, concurrency: int,
                    lease_seconds: float, rollout_timeout: float | None) -> None:
    from .._api import configure

    store = configure(store=store_url)
    with Runner(store, load_agent(reference), runner_id=runner_id, concurrency=concurrency,
                lease_seconds=lease_seconds, rollout_timeout=rollout_timeout) as runner:
        runner.run_until_done(group_ids)
    store.flush()


def run_in_processes(store_url: str, agent: Callable[[Any], Any], group_ids: Sequence[str], *, processes: int = 2,
                     threads_per_process: int = 1, lease_seconds: float = 60.0,
                     rollout_timeout: float | None = None) -> list[int]:
    """Run a sync agent in ``processes`` worker processes (each leasing from the same store file)
    until every try of ``group_ids`` is done. Returns the workers' exit codes."""
    import multiprocessing as mp

    if not store_url.startswith(("sqlite:", "http:", "https:")) and "://" in store_url:
        from ..errors import ConfigurationError

        raise ConfigurationError(f"worker processes need a store they can all open, got {store_url!r}")
    reference = agent_reference(agent)
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_process_worker, args=(store_url, reference, list(group_ids), f"proc-{i}",
                                                          threads_per_process, lease_seconds, rollout_timeout))
               for i in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [w.exitcode for w in workers]
