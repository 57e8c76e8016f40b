"""The narrow interface the tracer writes to. Stores implement it; the tracer knows nothing else."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..records import Reward, Rollout, RolloutStatus, SpanRow

__all__ = ["SpanRow", "SpanSink"]


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
        self, rollout_id: str, status: RolloutStatus, end_time: float, error: str | None,
        policy_version: int | None = None,
    ) -> None: ...

    # Optional: ``policy_versions() -> dict[str, int]``, the latest publish of each served name
    # (stores have it); the tracer stamps LLM calls from it.

    def flush(self, timeout: float | None = None) -> bool: ...
