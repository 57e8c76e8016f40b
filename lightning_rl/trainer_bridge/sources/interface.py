"""The sample-source interface: ``SampleSource``, the ``StepBatch`` a source hands the trainer per update,
and ``read_groups`` (a batch's groups read back from the store's queue), shared by every source."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...records import Sample, Trajectory
from ...store.protocols import Store
from ...store.queries import trajectory

@dataclass
class StepBatch:
    """Whole groups of rollouts for one update."""

    group_ids: list[str]
    groups: list[list[Trajectory]]  # each group's tries, in the order the queue holds them
    outcomes: dict[str, int] = field(default_factory=dict)  # the tries' queue outcomes (succeeded, failed, ...)
    metrics: dict[str, Any] = field(default_factory=dict)  # what the source measured while gathering them
    samples: list[Sample] | None = None  # chosen by the source (production: calls it can reproduce); None: all


class SampleSource(Protocol):
    def start(self) -> None:
        """Begin producing (queue the first groups, start the runner)."""

    def next_batch(self) -> StepBatch | None:
        """The next batch (blocking until it is there), or None when the source has no more."""

    def published(self, updates: int) -> None:
        """The weights of update number ``updates`` (1, 2, ...) are live."""

    def close(self) -> None:
        """Stop producing; what is in flight finishes and stays in the store."""


def read_groups(store: Store, group_ids: Sequence[str], *, credit: str = "final") -> StepBatch:
    """The groups' tries from the store's queue, each try's trajectory assembled once (``credit``)."""
    by_group: dict[str, list] = {g: [] for g in group_ids}
    for entry in store.queue_entries(list(group_ids)):
        by_group[entry.group_id].append(entry)
    outcomes: dict[str, int] = {}
    groups: list[list[Trajectory]] = []
    for entries in by_group.values():
        for e in entries:
            outcomes[str(e.outcome)] = outcomes.get(str(e.outcome), 0) + 1
        groups.append([trajectory(store, e.rollout_id, credit=credit) for e in entries if e.rollout_id])
    return StepBatch(list(group_ids), groups, outcomes)

