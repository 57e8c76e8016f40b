"""The task-set sources: groups of tries queued and run (``LiveGroups``) or read back from a run (``StoredGroups``).

* ``LiveGroups``: tasks queued n times (one group each) and run by the trainer's runner against the
  served model. Synchronous (``max_staleness=0``): a step's groups are queued, run to the end, then
  trained on, and the next step's are queued after the publish. Overlapped (``max_staleness=k``): the
  runner keeps working while the trainer updates; up to ``k + 1`` steps' groups are queued ahead, a
  batch is the first ``tasks_per_step`` groups to complete, and new weights go live while rollouts are
  in flight. Both are the same code: k = 0 queues one step ahead, so nothing runs during an update.
* ``StoredGroups``: replay. The batches of a run already in a store, rebuilt from what each published
  version was trained on (``PolicyRecord.trained_on``), or else the store's train groups in the order
  they were queued; nothing runs. Same store, seed and settings: the same loss sequence.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...boundaries import check_int
from ...errors import ConfigurationError, RunnerStoppedError
from ...records import Mode, QueueStatus
from ...store.protocols import Store
from .interface import StepBatch, read_groups


class LiveGroups:
    """Groups queued from a task set and run by a runner, synchronously or overlapped (module doc)."""

    def __init__(self, store: Store, tasks: Sequence[Any], *, n: int, tasks_per_step: int, steps: int,
                 max_staleness: int = 0, credit: str = "final", rng: random.Random | None = None,
                 work: Callable[[], Any] | None = None, stop: Callable[[], None] | None = None,
                 run_now: Callable[[list[str]], None] | None = None, poll: float = 0.05) -> None:
        """``work()`` starts the runner in the background and returns a future that ends after
        ``stop()``; ``run_now(groups)`` instead runs groups to the end when a batch is asked for
        (worker processes; synchronous only)."""
        if (work is None) == (run_now is None):
            raise ConfigurationError("LiveGroups needs exactly one of work= (a background runner) or run_now=")
        check_int(max_staleness, "max_staleness", meaning="0: synchronous")
        if run_now is not None and max_staleness:
            raise ConfigurationError(f"max_staleness={max_staleness} overlaps rollouts with updates, which worker "
                                     "processes (processes=) do not do yet; use processes=0 (async agents or "
                                     "threads) or max_staleness=0")
        self.store, self.tasks, self.n, self.tasks_per_step, self.steps = store, tasks, n, tasks_per_step, steps
        self.max_staleness, self.credit = max_staleness, credit
        self._rng = rng or random.Random(0)
        self._work, self._stop, self._run_now, self._poll = work, stop, run_now, poll
        self._future: Any = None
        self._outstanding: list[str] = []  # queued groups not yet handed to the trainer, in queue order
        self._queued_steps = 0
        self._updates = 0
        self._done_tries: set[str] = set()  # queue ids of tries seen done
        self._done_at_last = 0
        self._last_batch = time.monotonic()

    def start(self) -> None:
        self._queue()
        self._last_batch = time.monotonic()
        if self._work is not None:
            self._future = self._work()

    def _queue(self) -> None:
        """Queue steps' groups up to ``max_staleness + 1`` steps ahead of the updates done: a group
        queued while version v is live is trained on by an update at version v + max_staleness at the
        latest, unless it is among the slowest to complete (then its samples may be too stale)."""
        while self._queued_steps < min(self.steps, self._updates + self.max_staleness + 1):
            for _ in range(self.tasks_per_step):
                task = self.tasks[self._rng.randrange(len(self.tasks))]
                self._outstanding.append(self.store.enqueue(task, n=self.n, mode="train")[0].group_id)
            self._queued_steps += 1

    def _complete_groups(self) -> list[str]:
        entries = self.store.queue_entries(self._outstanding)
        open_groups = {e.group_id for e in entries if not e.status.finished}  # done or cancelled: closed
        self._done_tries.update(e.queue_id for e in entries if e.status == QueueStatus.DONE)
        return [g for g in self._outstanding if g not in open_groups]

    def next_batch(self) -> StepBatch | None:
        if not self._outstanding:
            return None
        asked = time.monotonic()
        if self._run_now is not None:
            self._run_now(list(self._outstanding))
        while True:
            if self._future is not None and self._future.done():
                self._future.result()  # the runner died: raise its error here
                raise RunnerStoppedError(
                    f"the runner stopped while {len(self._outstanding)} group(s) were still queued (first: "
                    f"{self._outstanding[0]!r}); stop it only after the last batch (close() does)")
            complete = self._complete_groups()
            if len(complete) >= min(self.tasks_per_step, len(self._outstanding)):
                break
            time.sleep(self._poll)
        taken = complete[: self.tasks_per_step]
        self._outstanding = [g for g in self._outstanding if g not in set(taken)]
        batch = read_groups(self.store, taken, credit=self.credit)
        now = time.monotonic()
        batch.metrics = {
            "idle_s": round(now - asked, 3),  # the trainer waited for rollouts this long
            # tries completed since the last batch (during the update too), per second of wall time
            "rollouts_per_s": round((len(self._done_tries) - self._done_at_last) / max(now - self._last_batch, 1e-9), 3),
            "groups_in_flight": len(self._outstanding),  # queued or running when the update starts
        }
        self._done_at_last, self._last_batch = len(self._done_tries), now
        return batch

    def published(self, updates: int) -> None:
        self._updates = updates
        self._queue()

    def close(self) -> None:
        if self._future is not None:
            if self._stop is not None:
                self._stop()
            self._future.result()
            self._future = None


class StoredGroups:
    """Replay: the batches of a run already in ``store``; nothing runs (module doc)."""

    def __init__(self, store: Store, *, credit: str = "final", tasks_per_step: int | None = None,
                 steps: int | None = None) -> None:
        self.store, self.credit, self.tasks_per_step, self.steps = store, credit, tasks_per_step, steps
        self.batches: list[list[str]] = []  # group ids, one list per update
        self.from_lineage = False
        self._read()

    def start(self) -> None:
        pass

    def _read(self) -> None:
        lineage = [tuple(p.trained_on) for p in self.store.policies() if getattr(p, "trained_on", None)]
        if lineage:  # a team's step publishes each policy it updated with the same batch: one batch
            self.batches = [list(b) for b in dict.fromkeys(lineage)]
            self.from_lineage = True
        else:
            groups = list(dict.fromkeys(e.group_id for e in self.store.queue_entries() if e.mode == Mode.TRAIN))
            if not groups:
                raise ConfigurationError(f"{self.store.url} has no training groups to replay (no publish says what "
                                         "it was trained on, and no train-mode tasks were queued)")
            if not self.tasks_per_step:
                raise ConfigurationError(f"{self.store.url}'s publishes do not say what they were trained on "
                                         f"(a run from before lineage was recorded); give tasks_per_step "
                                         f"(--tasks-per-step) to cut its {len(groups)} train groups into batches")
            size = self.tasks_per_step
            self.batches = [groups[i:i + size] for i in range(0, len(groups), size)]
        if self.steps is not None:
            self.batches = self.batches[: self.steps]

    def next_batch(self) -> StepBatch | None:
        if not self.batches:
            return None
        batch = read_groups(self.store, self.batches.pop(0), credit=self.credit)
        batch.metrics = {"idle_s": 0.0}
        return batch

    def published(self, updates: int) -> None:
        pass

    def close(self) -> None:
        pass
