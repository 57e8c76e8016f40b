"""The one dispatch of the writer's ops (``store/ops.py``) into a :class:`Batch`, rows by table in the order a
batch is written (``sort_ops``), and the two lifecycle steps a backend applies to a stored rollout
(``finished``, ``expired``). Every backend's ``_write`` takes a ``Batch``; ``kit/base.py`` re-exports these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ...records import Reward, Rollout, RolloutStatus, allowed_from
from ..ops import EncodedSpan, ExpireTry, FinishRollout, Op, Quarantine, StartRollout, TracedSpan, WriteReward
from ..rows import span_values


@dataclass(slots=True)
class Batch:
    """A batch of ops sorted by table, each list in op order (``sort_ops``)."""

    rollouts: list[Rollout] = field(default_factory=list)
    spans: list[tuple] = field(default_factory=list)  # ``spans`` rows (``rows.span_values``)
    rewards: list[Reward] = field(default_factory=list)
    finishes: list[FinishRollout] = field(default_factory=list)
    expires: list[Rollout] = field(default_factory=list)  # the queue's tombstones (``ExpireTry``)
    notes: list[Quarantine] = field(default_factory=list)


def sort_ops(ops: Iterable[Op]) -> Batch:
    """The one dispatch of the writer's ops: each to its table's list. An unknown op raises ``TypeError``."""
    batch = Batch()
    for op in ops:
        kind = type(op)
        if kind is TracedSpan:
            batch.spans.append(span_values(op.row))
        elif kind is EncodedSpan:
            batch.spans.append(op.values)
        elif kind is StartRollout:
            batch.rollouts.append(op.rollout)
        elif kind is WriteReward:
            batch.rewards.append(op.reward)
        elif kind is FinishRollout:
            batch.finishes.append(op)
        elif kind is ExpireTry:
            batch.expires.append(op.tombstone)
        elif kind is Quarantine:
            batch.notes.append(op)
        else:
            raise TypeError(f"not a writer op: {op!r:.80}")
    return batch


def finished(rollout: Rollout | None, op: FinishRollout) -> Rollout | None:
    """The rollout after ``op``, or None where the lifecycle refuses it (``records.TRANSITIONS``: counted by
    the caller as ``rejected_status_transitions``)."""
    if rollout is None or rollout.status not in allowed_from(op.status):
        return None
    return rollout.model_copy(update={
        "status": RolloutStatus(op.status), "end_time": op.end_time, "error": op.error,
        "policy_version": rollout.policy_version if op.policy_version is None else op.policy_version})


def expired(rollout: Rollout | None, tombstone: Rollout) -> Rollout:
    """The rollout after the queue gave up on its try: ``timed_out`` whatever it was (the tombstone if none)."""
    if rollout is None:
        return tombstone
    if rollout.status == RolloutStatus.TIMED_OUT:
        return rollout
    return rollout.model_copy(update={"status": RolloutStatus.TIMED_OUT, "end_time": tombstone.end_time,
                                      "error": tombstone.error})
