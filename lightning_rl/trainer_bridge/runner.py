"""Runners: lease tasks from the store's queue and execute the traced agent on them.

A runner leases up to ``concurrency`` entries, runs each under ``rollout_overrides`` (the entry's
rollout id, group, attempt, mode and task, the endpoint and sampling it carries, and the per-rollout
``timeout``), heartbeats while the
rollout runs, and completes the entry with the rollout's outcome. An exception (a failed model
call included) makes the outcome ``failed``, a timeout ``timed_out``: never a success. A runner
that dies stops heartbeating; its lease expires and the task is retried by another runner.

Async agents run as asyncio tasks on the runner's one event loop (several runners may share one
loop: ``loop=``). Sync agents run each in a thread of its own, started for that try, with a copied
context, or in worker processes (``run_in_processes``: each imports the agent by ``module:function``
and leases from the same SQLite store file). Store calls (lease, heartbeat, complete) run on a
pool of their own (one thread per try, and two more), so a runner full of slow sync agents still
heartbeats on time, also while a store outage makes those calls wait.

Timeouts: an async agent is cancelled inside its traced call; a sync agent cannot be stopped, so
the runner stops waiting for it, marks its rollout ``timed_out`` and completes the try; the thread
is left to finish on its own, and whatever it reports later cannot change the outcome. A try whose
lease has already run out when its agent would start is not run at all (its retry will be).

Beside it: the event-loop thread runners share (``loop_thread.py``) and agents named ``module:function``
(``agent_loading.py``); both are importable from here as before.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, LightningRLError, SandboxError, check_reward
from ..records import QueueEntry, Reward, RewardSource, RolloutStatus
from ..sandbox.tries import Tries, tries_of
from ..store.protocols import Store
from ..store.queries import wait_for_groups
from ..store.task_queue import check_wait
from ..tracer import rollout_overrides
from .agent_loading import agent_reference, load_agent
from .loop_thread import LoopThread

#: ``LoopThread`` (``loop_thread.py``), ``agent_reference`` and ``load_agent`` (``agent_loading.py``) are imported
#: from here too.
__all__ = ["LoopThread", "Runner", "agent_reference", "load_agent", "run_in_processes"]


class Runner:
    def __init__(self, store: Store, agent: Callable[[Any], Any], *, runner_id: str | None = None,
                 concurrency: int = 8, lease_seconds: float = 60.0, rollout_timeout: float | None = 120.0,
                 poll: float = 0.05, wait: float = 5.0, loop: asyncio.Runner | LoopThread | None = None,
                 sandboxes: Any = None, score: Callable[[Any, Any], float] | None = None, protect: Sequence[str] = (),
                 infra_retries: int = 2) -> None:
        if not isinstance(poll, (int, float)) or isinstance(poll, bool) or not poll > 0:
            raise ConfigurationError(f"poll is the pause between lease requests in seconds, got poll={poll!r}; "
                                     "give e.g. poll=0.05")
        if score is not None and sandboxes is None:
            raise ConfigurationError("score= runs in each try's sandbox after its agent: give sandboxes=SandboxPool(...)")
        self._owned_pool = None
        if isinstance(sandboxes, dict):  # a spec (a Ray actor's, a worker process's): this process builds its pool
            from ..sandbox.pool import pool_from_spec

            sandboxes = self._owned_pool = pool_from_spec(sandboxes)
        if isinstance(score, str):  # "module:function", as agents are named to other processes
            score = load_agent(score)
        self.store = store
        self.agent = agent
        #: each try's sandbox comes from this pool (``lrl.sandbox()`` in the agent; a dict: a spec this process builds
        #: its pool from, ``sandbox.pool.pool_from_spec``, as Ray actors are given it); after a try that succeeded,
        #: ``protect`` (paths: tests, .git) is restored in it and ``score(task, sandbox)`` (or "module:function") is
        #: its reward
        self.sandboxes, self.score, self.protect, self.infra_retries = sandboxes, score, tuple(protect), infra_retries
        self.runner_id = runner_id or f"runner-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.rollout_timeout = rollout_timeout
        self.poll = poll
        #: the longest one lease request waits in the store for a try (a long poll; 0: ask every ``poll`` s)
        self.wait = check_wait(wait)
        self._backoff = 0.0  # the pause after a failed lease, doubled up to 10 s while the store is away
        self._waits = True  # False for a store whose lease takes no ``wait``
        self.is_async = inspect.iscoroutinefunction(agent)
        self._aio: asyncio.Runner | None = loop
        self._owns_loop = loop is None
        # Store calls never queue behind agents (asyncio's default pool is shared with everything),
        # nor behind each other while an outage makes them wait: a thread per try, and two more.
        self._store_pool = ThreadPoolExecutor(max_workers=concurrency + 2, thread_name_prefix=f"{self.runner_id}-store")
        # A try's sandbox calls (make its task's pool, take one, score, give it back) run one after another in a
        # thread of their own: a try waiting for a free sandbox blocks its thread, and never the give-back of the
        # try that would free one (in asyncio's default pool, 6 threads here, they did: a stall for good).
        self._sandbox_pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"{self.runner_id}-sandbox")
        self._stopping = False
        self._last_busy = time.monotonic()

    def run_until_done(self, group_ids: Sequence[str], *, on_done: Callable[[QueueEntry, str], None] | None = None) -> None:
        """Lease and run tries until every try of ``group_ids`` is done.

        Every call runs on the runner's one event loop: async clients (AsyncOpenAI's connection
        pool) are bound to the loop they first ran on, and a new loop per call breaks them
        ("Event loop is closed")."""
        groups = list(group_ids)

        async def groups_done() -> bool:  # others' leases may still expire and come back
            return await self._store_call(wait_for_groups, self.store, groups, timeout=0)

        self._stopping = False  # short waits: the groups' last try may be another runner's, then done
        self._run(self._drive(groups_done, on_done=on_done, wait=min(self.wait, 0.25)))

    def serve(self, *, idle_exit: float | None = None, max_rollouts: int | None = None) -> int:
        """Lease and run tries from the whole queue until stopped (SIGTERM/SIGINT), idle for
        ``idle_exit`` seconds, or ``max_rollouts`` done. Returns how many tries it ran. A store that
        stops answering (a server restart) is waited out: the loop retries, it does not die."""

        async def idle_long_enough() -> bool:
            return idle_exit is not None and time.monotonic() - self._last_busy >= idle_exit

        self._stopping = False
        wait = self.wait if idle_exit is None else min(self.wait, max(idle_exit / 2, 0.0))
        return self._run(self._drive(idle_long_enough, max_rollouts=max_rollouts, wait=wait))

    def stop(self) -> None:
        """Lease nothing more; the tries in hand finish, then ``serve`` (or ``work``) returns."""
        self._stopping = True

    async def work(self) -> int:
        """Lease and run tries from the queue until ``stop()``, on the running loop (a trainer runs
        it in the background while it updates). Returns how many tries ran."""

        async def never() -> bool:
            return False

        return await self._drive(never)

    def _run(self, coro: Any) -> Any:
        if self._aio is None:
            self._aio = asyncio.Runner()
        return self._aio.run(coro)

    async def _store_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._store_pool, lambda: fn(*args, **kwargs))

    async def _sandbox_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        ctx = contextvars.copy_context()  # as asyncio.to_thread does: the score sees the try's context
        return await asyncio.get_running_loop().run_in_executor(self._sandbox_pool, ctx.run, fn, *args)

    async def _drive(self, idle_done: Callable[[], Any], *, max_rollouts: int | None = None,
                     on_done: Callable[[QueueEntry, str], None] | None = None, wait: float | None = None) -> int:
        """The one lease-and-run loop. When nothing runs, ``await idle_done()`` True ends it. A lease is
        asked for whenever a slot is free and runs beside the tries in hand: with ``wait`` it waits in the
        store (a long poll) and answers the moment a try is queued; without, it asks every ``poll`` seconds.
        Returns how many tries ran."""
        running: set[asyncio.Task] = set()
        leasing: asyncio.Task | None = None
        asked = 0.0
        ran = 0
        self._last_busy = time.monotonic()
        # a try's lease runs from (at the latest) the moment we asked: a wait well under the lease leaves it time
        wait = min(self.wait if wait is None else wait, self.lease_seconds / 4)
        while True:
            free = self.concurrency - len(running)
            if max_rollouts is not None:
                free = min(free, max_rollouts - ran - len(running))
            if leasing is None and free > 0 and not self._stopping:
                if not running and await idle_done():
                    return ran
                asked = time.monotonic()
                leasing = asyncio.create_task(self._lease(free, wait))
            if running:
                self._last_busy = time.monotonic()
            if leasing is None and not running:
                return ran  # stopped, or max_rollouts ran
            done, _ = await asyncio.wait(running | ({leasing} if leasing else set()), timeout=self.poll,
                                         return_when=asyncio.FIRST_COMPLETED)
            if leasing is not None and leasing.done():  # what it got runs, even after stop(): it is ours now
                for entry in leasing.result():
                    running.add(asyncio.create_task(self._run_one(entry, asked, on_done)))
                leasing = None
            for task in done & running:
                running.discard(task)
                ran += 1
                if task.exception() is not None:
                    report_failure("runner task", task.exception())

    async def _lease(self, limit: int, wait: float) -> list[QueueEntry]:
        try:
            if wait > 0 and self._waits:
                try:
                    got = await self._store_call(self.store.lease, self.runner_id, lease_seconds=self.lease_seconds,
                                                 limit=limit, wait=wait)
                except TypeError as exc:  # a store of the user's, from before long polls: it is polled
                    if "wait" not in str(exc):
                        raise
                    self._waits = False
                    count("runner_store_without_wait")
                    return []
            else:  # any store, the ones before long polls too
                got = await self._store_call(self.store.lease, self.runner_id, lease_seconds=self.lease_seconds,
                                             limit=limit)
        except ConfigurationError:  # a setting to fix (a token without the runner role: 403): retrying cannot help
            raise
        except LightningRLError as exc:  # the store is away (a server restart): wait longer each time, then again
            report_failure("runner lease", exc)
            count("runner_lease_errors")
            self._backoff = min(max(self._backoff * 2, 0.5), 10.0)
            await asyncio.sleep(self._backoff)
            return []
        self._backoff = 0.0
        if not got and (wait <= 0 or not self._waits):
            await asyncio.sleep(self.poll)
        return got

    def close(self) -> None:
        if self._aio is not None and self._owns_loop:
            self._aio.close()
        self._aio = None
        self._store_pool.shutdown(wait=False)
        self._sandbox_pool.shutdown(wait=False)
        if self._owned_pool is not None:
            self._owned_pool.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _heartbeat(self, entry: QueueEntry, lease: "_Lease") -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            sent = time.monotonic()
            try:
                held = await self._store_call(self.store.heartbeat, entry.queue_id, self.runner_id,
                                              lease_seconds=self.lease_seconds, rollout_id=entry.rollout_id)
            except LightningRLError as exc:  # the store is away; keep beating, the lease may survive
                report_failure("runner heartbeat", exc)
                continue
            if held:
                lease.until = sent + self.lease_seconds
            else:
                lease.lost = True
                count("runner_leases_lost")

    async def _run_one(self, entry: QueueEntry, asked: float, on_done) -> None:
        lease = _Lease(asked + self.lease_seconds)
        beat = asyncio.create_task(self._heartbeat(entry, lease))
        outcome: RolloutStatus | None = RolloutStatus.SUCCEEDED
        overrides = dict(rollout_id=entry.rollout_id, group_id=entry.group_id, attempt=entry.attempt,
                         mode=entry.mode.value, task=entry.task, timeout=self.rollout_timeout)
        if entry.overrides:  # what the try is run with (a verl server's endpoint, verl's sampling)
            if entry.overrides.get("endpoint"):
                overrides["endpoint"] = tuple(entry.overrides["endpoint"])
            if entry.overrides.get("sampling"):
                overrides["sampling"] = dict(entry.overrides["sampling"])
        tries = None if self.sandboxes is None else Tries(self.sandboxes, self.infra_retries)
        try:
            if tries is not None:  # taken before the agent starts (off the loop): a start never blocks other tries
                try:
                    if not hasattr(self.sandboxes, "acquire"):  # a pool per task (PoolPerTask): this task's
                        try:
                            tries.pool = await self._sandbox_call(self.sandboxes, entry.task)
                        except Exception as exc:  # its snapshot could not be made: no try of it can run
                            raise SandboxError(f"the task's sandbox pool could not be made: "
                                               f"{type(exc).__name__}: {exc}") from exc
                    try:
                        await self._sandbox_call(tries.take, entry.rollout_id)
                    except SandboxError:
                        raise
                    except Exception as exc:  # a pool that cannot give one (a bad option, a closed snapshot)
                        raise SandboxError(f"no sandbox for the try: {type(exc).__name__}: {exc}") from exc
                except SandboxError as exc:  # its starts failed past the retries: the world's failure, not the model's
                    await self._store_call(self.store.expire_rollout, entry, f"SandboxError: {exc}")
                    raise TimeoutError(str(exc)) from None
            with rollout_overrides(**overrides), tries_of(tries):
                if self.is_async:
                    if lease.expired():
                        raise _LeaseGone
                    await self.agent(entry.task)
                else:
                    await self._run_sync(entry, lease)
            if tries is not None and self.score is not None:
                await self._sandbox_call(self._score, entry, tries)
        except _LeaseGone:
            outcome = None  # never started: the queue retries the try under a new rollout id
            count("runner_tries_not_started_lease_expired")
        except (TimeoutError, asyncio.TimeoutError):
            outcome = RolloutStatus.TIMED_OUT
        except Exception:
            outcome = RolloutStatus.FAILED  # recorded on the rollout by @trace; never a success
        finally:
            beat.cancel()
            if tries is not None:
                await self._sandbox_call(tries.give_back)
        if outcome is None:
            return
        await self._complete(entry, outcome)
        if on_done is not None:
            on_done(entry, outcome.value)

    async def _run_sync(self, entry: QueueEntry, lease: "_Lease") -> None:
        """Run a sync agent in a thread of its own; stop waiting for it after the rollout timeout."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        ctx = contextvars.copy_context()

        def settle(error: BaseException | None) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(None)

        def target() -> None:
            error: BaseException | None = None
            if lease.expired():  # it waited too long to start: another runner may hold the try now
                error = _LeaseGone()
            else:
                try:
                    ctx.run(self.agent, entry.task)
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                    error = exc
            try:
                loop.call_soon_threadsafe(settle, error)
            except RuntimeError:  # the loop is closed: nobody waits for this try any more
                pass

        threading.Thread(target=target, name=f"{self.runner_id}-agent", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), self.rollout_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            done.cancel()  # whatever the thread reports later goes nowhere
            count("runner_sync_agents_abandoned")
            reason = (f"rollout timeout of {self.rollout_timeout:g} s: the sync agent was still running; "
                      "its thread was left to finish, and its result is not used")
            self.store.expire_rollout(entry, reason)
            raise

    def _score(self, entry: QueueEntry, tries: "Tries") -> None:
        """The reward of a try that succeeded, computed in its sandbox with the protected paths restored first (no
        agent edits its way to a reward); a score that fails is counted and logged, and the try has no reward."""
        box = tries.leases.get(entry.rollout_id)
        if box is None:
            return
        try:
            restored = box[1].restore(self.protect) if self.protect else []
            if restored:
                count("sandbox_protected_restored", len(restored))
            value = check_reward(self.score(entry.task, box[1]), what="the score of the try's sandbox")
            self.store.write_reward(Reward(rollout_id=entry.rollout_id, value=value, source=RewardSource.FUNCTION))
        except Exception as exc:  # noqa: BLE001 - one try's score never stops the runner
            report_failure("sandbox score", exc)

    async def _complete(self, entry: QueueEntry, outcome: RolloutStatus) -> None:
        """Record the outcome; while the store is away, keep trying for as long as a lease lasts."""
        deadline = time.monotonic() + self.lease_seconds
        while True:
            try:
                await self._store_call(self.store.complete, entry.queue_id, self.runner_id, outcome,
                                       rollout_id=entry.rollout_id)
                return
            except ConfigurationError:  # refused (403), not away: the lease expires and another runner retries
                raise
            except LightningRLError as exc:
                report_failure("runner complete", exc)
                if time.monotonic() >= deadline:
                    return  # the lease expires and the try is retried; its rollout is kept
                await asyncio.sleep(1.0)


class _LeaseGone(Exception):
    """The lease ran out before the agent could start."""


class _Lease:
    __slots__ = ("until", "lost")

    def __init__(self, until: float) -> None:
        self.until = until
        self.lost = False

    def expired(self) -> bool:
        return self.lost or time.monotonic() >= self.until


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
