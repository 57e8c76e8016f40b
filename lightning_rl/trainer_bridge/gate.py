"""The gate before going live: a candidate adapter is evaluated beside the live one, and promoted only
when it is not worse (``noninferiority.not_worse``).

The candidate is loaded into the engine under a served name of its own (``<served_name>-candidate``;
the live name keeps serving production meanwhile), the agent runs each gate task ``n`` times against
it, in ``mode="eval"`` (production streams never train on it), and the live policy likewise (once per
live version: its figure is kept while it stays live). The agent is the one the trainer evaluates
with: it calls the model that ``lrl.current_endpoint()`` names (``(base_url, served name)``), as verl's
agents do. A try's reward is its rollout's final reward, a failed try's 0 (``Trainer.evaluate``'s
rule). The candidate's name is unloaded afterwards (the server needs ``--max-loras 2``).

Over a replica set (``server_url`` a list, ``replicas.py``) the candidate is loaded on every replica and
the tries are spread over them in turn, so a replica that serves the candidate differently shows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from typing import Any

from ..diagnostics import report_failure
from ..errors import LightningRLError, PublishError
from ..records import RolloutStatus
from ..store.queries import trajectory
from ..tracer import rollout_overrides
from .noninferiority import GateTest, not_worse
from .publishers import load_served, unload_served
from .replicas import Replicas
from .loop_thread import LoopThread


class Gate:
    """Evaluate candidates against the live policy on ``tasks`` (module doc)."""

    def __init__(self, store: Any, agent: Callable[[Any], Any], tasks: Sequence[Any], *,
                 server_url: str | Sequence[str] | Replicas, served_name: str, n: int = 1, margin: float = 0.1,
                 confidence: float = 0.9, concurrency: int = 8, timeout: float = 120.0) -> None:
        self.store, self.agent, self.tasks, self.n = store, agent, list(tasks), n
        self.replicas = Replicas(server_url)
        self.server_url = self.replicas.urls[0]
        self.served_name, self.candidate_name = served_name, f"{served_name}-candidate"
        self.margin, self.confidence, self.concurrency, self.timeout = margin, confidence, concurrency, timeout
        self._live: tuple[int, list[float]] | None = None  # (version, its rewards) while it stays live
        self._loop: LoopThread | None = None

    def rewards(self, served: str) -> list[float]:
        """One reward per try: every gate task ``n`` times, the agent calling ``served``."""
        tries = [(task, f"gate-{uuid.uuid4().hex}") for task in self.tasks for _ in range(self.n)]
        group = f"gate-{served}-{uuid.uuid4().hex[:8]}"
        urls = {rid: self.replicas.urls[i % len(self.replicas)] for i, (_, rid) in enumerate(tries)}

        def overrides(task: Any, rid: str) -> Any:
            return rollout_overrides(rollout_id=rid, group_id=group, mode="eval", task=task,
                                     endpoint=(f"{urls[rid]}/v1", served), timeout=self.timeout)

        if inspect.iscoroutinefunction(self.agent):
            async def one(task: Any, rid: str, limit: asyncio.Semaphore) -> None:
                async with limit:
                    with overrides(task, rid):
                        try:
                            await self.agent(task)
                        except Exception:  # noqa: BLE001 - recorded on the rollout by @trace; it scores 0
                            pass

            async def every() -> None:
                limit = asyncio.Semaphore(self.concurrency)
                await asyncio.gather(*(one(task, rid, limit) for task, rid in tries))

            if self._loop is None:
                self._loop = LoopThread("lightning-rl-gate")
            self._loop.run(every())
        else:
            def one_sync(task: Any, rid: str) -> None:
                with overrides(task, rid):
                    self.agent(task)

            # A sync agent cannot be stopped: past the tries' time (the timeout per round of `concurrency`
            # tries) the gate stops waiting; a try still running then has not succeeded, so it scores 0.
            pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="lightning-rl-gate")
            futures = [pool.submit(copy_context().run, one_sync, task, rid) for task, rid in tries]
            concurrent.futures.wait(futures, timeout=self.timeout * math.ceil(len(tries) / self.concurrency))
            pool.shutdown(wait=False, cancel_futures=True)
        self.store.flush()
        return [self._reward(rid) for _, rid in tries]

    def _reward(self, rollout_id: str) -> float:
        try:
            if self.store.get_rollout(rollout_id).status != RolloutStatus.SUCCEEDED:
                return 0.0
            return trajectory(self.store, rollout_id).final_reward or 0.0
        except LightningRLError:  # the agent failed before its rollout began
            return 0.0

    def live_rewards(self, live_version: int) -> list[float]:
        """The live policy's rewards: measured once per live version, then kept."""
        if self._live is None or self._live[0] != live_version:
            self._live = (live_version, self.rewards(self.served_name))
        return self._live[1]

    def check(self, candidate_adapter: str, live_version: int) -> GateTest:
        """Load ``candidate_adapter`` under the candidate's name, evaluate it and the live policy, and test."""
        load_served(self.replicas, self.candidate_name, candidate_adapter)
        try:
            candidate = self.rewards(self.candidate_name)
        finally:
            try:
                unload_served(self.replicas, self.candidate_name)
            except PublishError as exc:  # the slot is reused by the next candidate (load_inplace) anyway
                report_failure("gate candidate unload", exc, message=(
                    f"lightning-rl: the gate could not unload {self.candidate_name!r} from {list(self.replicas.urls)} "
                    f"({exc}); the next candidate replaces it in place (counted, logged once)"))
        live = self.live_rewards(live_version)
        return not_worse(candidate, live, margin=self.margin, confidence=self.confidence)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None
