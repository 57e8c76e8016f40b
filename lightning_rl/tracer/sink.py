"""The narrow interface the tracer writes to. Stores implement it; the tracer knows nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..records import Reward, Rollout, RolloutStatus


@dataclass(slots=True)
class SpanRow:
    """A finished span on its way to a store (hot path: no validation, no serialization yet)."""

    rollout_id: str
    seq: int
    trace_id: int
    span_id: int
    parent_id: int | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    status_code: str
    status_message: str | None
    attributes: Mapping[str, Any]
    events: Sequence[Any]


@runtime_checkable
class SpanSink(Protocol):
    """Where the tracer sends rollouts, spans and rewards.

    Implementations must not drop data: when they cannot keep up they block the caller
    (back-pressure) or spill to disk. ``flush`` returns once everything written so far is durable.
    """

    def start_rollout(self, rollout: Rollout) -> None: ...

    def write_span(self, row: SpanRow) -> None: ...

    def write_reward(self, reward: Reward) -> None: ...

    def finish_rollout(
        self, rollout_id: str, status: RolloutStatus, end_time: float, error: str | None
    ) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...
