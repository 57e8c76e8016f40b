"""The writer's operations: one vocabulary for everything a store writes in the background.

The sink methods (``start_rollout``, ``write_span``, ...) make these objects; a store's background
writer queues them in order; ``SQLiteStore`` applies them in one transaction per batch,
``InMemoryStore`` applies them at once, and ``HttpStore`` encodes them as the store server's wire
ops (``wire.encode``, also the form a spill file holds). The server turns a validated batch back into
these objects (``wire.to_ops``), so one batch means the same thing whichever way it came.

Plain slotted dataclasses: one is made per span on the agent's thread (STYLE rule 4).
``kind`` names each in the quarantine table (``QuarantinedRecord.kind``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..records import Reward, Rollout, RolloutStatus, SpanRow


@dataclass(slots=True)
class StartRollout:
    """A rollout began (inserted once per ``rollout_id``; a repeat is ignored)."""

    kind: ClassVar[str] = "rollout"
    rollout: Rollout


@dataclass(slots=True)
class TracedSpan:
    """A span the tracer finished, encoded as a ``spans`` row on the writer's thread (off the agent's)."""

    kind: ClassVar[str] = "span"
    row: SpanRow


@dataclass(slots=True)
class EncodedSpan:
    """A span already encoded as a ``spans`` row (``rows.span_record_values``): ingested with ``add_spans``,
    or validated by the store server. Whole prompts and messages; the writer shares their prefixes."""

    kind: ClassVar[str] = "span"
    values: tuple


@dataclass(slots=True)
class WriteReward:
    """A reward (stored once per ``uid``)."""

    kind: ClassVar[str] = "reward"
    reward: Reward


@dataclass(slots=True)
class FinishRollout:
    """A status transition to a final status, allowed or refused (and counted) by ``records.TRANSITIONS``."""

    kind: ClassVar[str] = "finish"
    rollout_id: str
    status: RolloutStatus
    end_time: float
    error: str | None = None
    #: The rollout's version, derived from its LLM calls when it ends (the oldest that served it).
    policy_version: int | None = None


@dataclass(slots=True)
class ExpireTry:
    """The task queue gave up on a try: its rollout is ``timed_out`` whatever it reports, now or later
    (applied after everything else of its batch). ``tombstone`` is the rollout row written if the try
    never started; its ``end_time`` and ``error`` are the expiry's."""

    kind: ClassVar[str] = "expire"
    tombstone: Rollout


@dataclass(slots=True)
class Quarantine:
    """A record that could not even be kept as it was (JSON cannot hold it, or a spill line this version
    cannot read): its description, for the quarantine table."""

    kind: ClassVar[str] = "quarantine"
    what: str  # the kind of the record it describes (or "spill line")
    rollout_id: str | None
    reason: str
    payload: str


Op = StartRollout | TracedSpan | EncodedSpan | WriteReward | FinishRollout | ExpireTry | Quarantine
OPS = (StartRollout, TracedSpan, EncodedSpan, WriteReward, FinishRollout, ExpireTry, Quarantine)


_ROLLOUT_ID = {
    StartRollout: lambda op: op.rollout.rollout_id,
    TracedSpan: lambda op: op.row.rollout_id,
    EncodedSpan: lambda op: op.values[0],
    WriteReward: lambda op: op.reward.rollout_id,
    FinishRollout: lambda op: op.rollout_id,
    ExpireTry: lambda op: op.tombstone.rollout_id,
    Quarantine: lambda op: op.rollout_id,
}


def rollout_of(op: Op) -> str | None:
    """The rollout an op belongs to, when it can be told."""
    try:
        found = _ROLLOUT_ID[type(op)](op)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return found if isinstance(found, str) else None
