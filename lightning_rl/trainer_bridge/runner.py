"""Runners: lease tasks from the store's queue and execute the traced agent on them.

A runner leases up to ``concurrency`` entries, runs each under ``rollout_overrides`` (the entry's
rollout id, group, attempt, mode and task, and the per-rollout ``timeout``), heartbeats while the
rollout runs, and completes the entry with the rollout's outcome. An exception (a failed model
call included) makes the outcome ``failed``, a timeout ``timed_out``: never a success. A runner
that dies stops heartbeating; its lease expires and the task is retried by another runner.

Async agents run as asyncio tasks. Sync agents run in threads with a copied context (see
docs/architecture.md for why not processes yet).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..records import QueueEntry, RolloutStatus
from ..store.base import Store
from ..tracer import rollout_overrides
from ..tracer.diagnostics import report_failure


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

    def run_until_done(self, group_ids: Sequence[str], *, on_done: Callable[[QueueEntry, str], None] | None = None) -> None:
        """Lease and run tries until every try of ``group_ids`` is done.

        Every call runs on the runner's one event loop: async clients (AsyncOpenAI's connection
        pool) are bound to the loop they first ran on, and a new loop per call breaks them
        ("Event loop is closed")."""
        if self._aio is None:
            self._aio = asyncio.Runner()
        self._aio.run(self._loop(list(group_ids), on_done))

    def close(self) -> None:
        if self._aio is not None:
            self._aio.close()
            self._aio = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _loop(self, group_ids: list[str], on_done) -> None:
        running: set[asyncio.Task] = set()
        while True:
            free = self.concurrency - len(running)
            if free > 0:
                for entry in await asyncio.to_thread(self.store.lease, self.runner_id,
                                                     lease_seconds=self.lease_seconds, limit=free):
                    running.add(asyncio.create_task(self._run_one(entry, on_done)))
            if not running:
                if await asyncio.to_thread(self.store.wait_for_groups, group_ids, timeout=0):
                    return
                await asyncio.sleep(self.poll)  # others' leases may still expire and come back
                continue
            done, running = await asyncio.wait(running, timeout=self.poll, return_when=asyncio.FIRST_COMPLETED)
            running = set(running)
            for task in done:
                if task.exception() is not None:
                    report_failure("runner task", task.exception())

    async def _heartbeat(self, entry: QueueEntry) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            await asyncio.to_thread(self.store.heartbeat, entry.queue_id, self.runner_id, lease_seconds=self.lease_seconds)

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
