"""A rollout and what a store keeps with it: the base of every persisted record (``schema_version``,
unknown fields forbidden), the rollout's lifecycle (``RolloutStatus``, ``TRANSITIONS``, enforced by
``check_transition`` alone), ``Rollout``, ``Reward``, a quarantined record, and the rollout page a
viewer asks for (``RolloutQuery``, ``RolloutPage``)."""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..boundaries import Int64, NonNegativeInt64
from ..errors import ConfigurationError, check_reward

SCHEMA_VERSION = 1


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION


class Mode(StrEnum):
    TRAIN = "train"
    EVAL = "eval"
    PROD = "prod"


class RolloutStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.TIMED_OUT})

#: The allowed lifecycle transitions, enforced by :func:`check_transition` (the one place).
TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    RolloutStatus.QUEUED: frozenset({RolloutStatus.RUNNING, RolloutStatus.FAILED}),
    RolloutStatus.RUNNING: frozenset(
        {RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.TIMED_OUT, RolloutStatus.QUEUED}
    ),
    RolloutStatus.SUCCEEDED: frozenset(),
    RolloutStatus.FAILED: frozenset(),
    RolloutStatus.TIMED_OUT: frozenset(),
}


def check_transition(old: RolloutStatus | str, new: RolloutStatus | str) -> RolloutStatus:
    old, new = RolloutStatus(old), RolloutStatus(new)
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(TRANSITIONS[old])) or "none (it is final)"
        raise ConfigurationError(
            f"a rollout cannot go from {old.value!r} to {new.value!r}; allowed from {old.value!r}: {allowed}"
        )
    return new


def allowed_from(new: RolloutStatus | str) -> frozenset[RolloutStatus]:
    """The statuses from which a rollout may move to ``new`` (from ``TRANSITIONS``)."""
    new = RolloutStatus(new)
    return frozenset(old for old, targets in TRANSITIONS.items() if new in targets)


class RewardSource(StrEnum):
    RETURNED = "returned"  # the traced function returned a number
    EMITTED = "emitted"  # emit_reward() inside the rollout
    FEEDBACK = "feedback"  # store.add_reward() after the fact (user feedback)
    FUNCTION = "function"  # a reward function computed it from the trajectory


class Rollout(_Record):
    """One call of a traced function."""

    rollout_id: str
    name: str = ""
    agent: str | None = None
    task: Any = None
    group_id: str | None = None
    attempt: Int64 = 0
    mode: Mode = Mode.TRAIN
    status: RolloutStatus = RolloutStatus.RUNNING
    policy_version: Int64 | None = None
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None
    error: str | None = None
    #: What opened it where that matters for its end: "gateway" for a rollout opened over the gateway's
    #: HTTP API (its key lives in that gateway's memory); None for a traced function's own.
    origin: str | None = None


ROLLOUT_SORTS = ("start_time", "reward", "status", "agent", "mode", "policy_version", "rollout_id")


class RolloutQuery(BaseModel):
    """A filtered, sorted page of rollouts (``Store.rollout_page``; the viewer's list). ``reward`` is the
    sum of the rollout's rewards named ``reward`` (returned, emitted mid-run and late); ``text`` matches
    the task's JSON or the rollout id."""

    model_config = ConfigDict(extra="forbid")
    mode: Mode | None = None
    status: RolloutStatus | None = None
    agent: str | None = None
    group_id: str | None = None
    policy_version: Int64 | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    text: str | None = None
    sort: str = "start_time"
    descending: bool = True
    offset: NonNegativeInt64 = 0
    limit: int = Field(default=50, ge=1, le=1000)

    @field_validator("sort")
    @classmethod
    def _known_sort(cls, value: str) -> str:
        if value not in ROLLOUT_SORTS:
            raise ValueError(f"sort must be one of {', '.join(ROLLOUT_SORTS)}, got {value!r}")
        return value


class RolloutRow(BaseModel):
    rollout: Rollout
    reward: float | None = None  # the sum of its rewards named "reward" (None: none yet)
    rewards: int = 0  # how many such rewards


class RolloutPage(BaseModel):
    rows: list[RolloutRow]
    total: int  # rollouts matching the filters, over all pages


class Reward(_Record):
    """A reward for a rollout, or for one LLM call of it (``llm_call_index``)."""

    rollout_id: str
    value: float
    name: str = "reward"
    llm_call_index: Int64 | None = None
    agent: str | None = None
    source: RewardSource = RewardSource.EMITTED
    time: float = Field(default_factory=time.time)
    #: Idempotency key: a reward sent twice (a retried HTTP batch, a replayed spill file) is stored once.
    uid: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=128)

    @field_validator("value", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> float:
        return check_reward(value)


class QuarantinedRecord(_Record):
    """A record a store set aside because it could not be written (a value SQLite cannot hold, a
    payload from another version), kept with the reason and its original form so nothing is lost.
    ``lightning-rl store doctor`` lists them; the rest of their batch was written."""

    quarantine_id: int
    time: float
    kind: str  # what it was: rollout, span, reward, finish, expire, or a spill line that could not be read
    rollout_id: str | None = None
    reason: str
    payload: str  # the record as JSON text (the spill file's form), or a bounded description of it
