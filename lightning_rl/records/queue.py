"""The store's task queue: one ``QueueEntry`` per try of a task, its ``QueueStatus``, and the overrides a
queued try may carry for its runner (``QUEUE_OVERRIDE_KEYS``, ``SAMPLING_KEYS``)."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

from pydantic import Field

from ..boundaries import Int64
from .rollouts import Mode, RolloutStatus, _Record

class QueueStatus(StrEnum):
    """``queued`` -> ``leased`` -> ``done`` (a lease that expires queues the try again); ``queued`` or
    ``leased`` -> ``cancelled`` (``TaskQueue.cancel``: no runner takes it again, its result is refused)."""

    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """No runner works on the try any more (done, or cancelled): nothing waits for it."""
        return self in _FINISHED


_FINISHED = frozenset({QueueStatus.DONE, QueueStatus.CANCELLED})


#: Sampling parameters a trainer may impose on every request of a rollout (``rollout_overrides(sampling=)``).
SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "repetition_penalty", "seed"})
#: What a queued try may carry for its runner (``QueueEntry.overrides``).
QUEUE_OVERRIDE_KEYS = frozenset({"endpoint", "sampling"})


class QueueEntry(_Record):
    """One attempt at a task in the store's task queue (a task tried n times = n entries, one group)."""

    queue_id: str
    group_id: str
    task: Any = None
    attempt: Int64 = 0
    mode: Mode = Mode.TRAIN
    status: QueueStatus = QueueStatus.QUEUED
    runner: str | None = None  # who holds the lease, or who completed it
    lease_expires: float | None = None
    lease_key: str | None = None  # the key of the lease request that handed out this try (retries reuse it)
    tries: Int64 = 0  # how many times it was leased (a retry after a dead runner is another try)
    max_tries: Int64 = 3
    rollout_id: str | None = None  # the rollout of the current (or last) try
    outcome: RolloutStatus | None = None  # succeeded / failed / timed_out, when done
    #: What the runner runs this try with (``rollout_overrides``): ``endpoint`` ``[base_url, model]`` (what
    #: ``lrl.current_endpoint()`` answers) and ``sampling`` (imposed on every request), e.g. a verl server.
    overrides: dict[str, Any] | None = None
    created: float = Field(default_factory=time.time)
