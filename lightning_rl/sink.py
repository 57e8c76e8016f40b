"""The narrow interface the tracer writes to. Stores implement it; the tracer knows nothing else.

It sits at the bottom of the package (DESIGN.md, "Layers"), beside the records it carries: the tracer writes
to it and the store's ``Store`` protocol begins with it (``store/protocols.py``), and neither imports the other.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .records import Reward, Rollout, RolloutStatus, SpanRow

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

    # Optional: ``latest_policies()`` and ``latest_decisions()`` (``tracer/versions.py`` ``PolicyLogReader``;
    # every store has them: its PolicyLog); the tracer stamps LLM calls with the versions and routes canaries.

    def flush(self, timeout: float | None = None) -> bool: ...
