"""Persisted and wire records (pydantic v2). See DESIGN.md, "Records".

Every record forbids unknown fields and carries ``schema_version`` so that readers can tell a
record from a newer writer. Hot-path internals use plain dataclasses instead (``SpanRow``: a finished
span on its way from the tracer to a store, shared by both layers).
"""

from __future__ import annotations

import math
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .boundaries import Int64, NonNegativeInt64
from .errors import ConfigurationError, check_reward

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


class RewardSource(StrEnum):
    RETURNED = "returned"  # the traced function returned a number
    EMITTED = "emitted"  # emit_reward() inside the rollout
    FEEDBACK = "feedback"  # store.add_reward() after the fact (user feedback)
    FUNCTION = "function"  # a reward function computed it from the trajectory


class TokenIdsSource(StrEnum):
    ENGINE = "engine"
    RETOKENIZED = "retokenized"
    MISSING = "missing"


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


class SpanTokens(BaseModel):
    """The engine's token ids and log-probs of one LLM call, as read back from a store.

    They travel beside the span's OpenTelemetry attributes, never inside them (see :class:`PackedTokens`)."""

    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None = None


class Span(_Record):
    """An OpenTelemetry span as recorded, with its rollout and per-rollout sequence number, and the
    engine's token arrays of an LLM call (``tokens``; not an OTel attribute)."""

    rollout_id: str
    seq: Int64
    trace_id: str
    span_id: str
    parent_id: str | None = None
    name: str
    kind: str = "INTERNAL"
    start_ns: Int64
    end_ns: Int64
    status_code: str = "UNSET"
    status_message: str | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)
    events: list[dict[str, Any]] = Field(default_factory=list)
    tokens: SpanTokens | None = None


# -- packed token arrays: the capture hot path ---------------------------------------------------------
# Token ids are int32 little-endian (every tokenizer's vocabulary fits); log-probs carry a one-byte
# type code first: b"f" float32 when that keeps every value exactly (vLLM computes them in float32),
# else b"d" float64. Nothing is converted element by element in Python.
def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as int32 LE bytes (``struct`` packs a list in C; ``array`` would convert one by one).
    OverflowError for an id outside int32, TypeError for one that is not an int."""
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise (TypeError if "integer" in str(exc) and "range" not in str(exc) else OverflowError)(
            f"token ids must be int32 values: {exc}") from None


def unpack_ids(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def pack_logprobs(values: Sequence[float]) -> bytes:
    """Log-probs as b"f" + float32 LE when that keeps every value exactly, else b"d" + float64 LE."""
    n = len(values)
    narrow = struct.pack(f"<{n}f", *values)
    if struct.unpack(f"<{n}f", narrow) == tuple(values):
        return b"f" + narrow
    return b"d" + struct.pack(f"<{n}d", *values)


def unpack_logprobs(data: bytes) -> list[float]:
    code = data[:1]
    width = 4 if code == b"f" else 8 if code == b"d" else 0
    if not width or (len(data) - 1) % width:
        raise ValueError(f"packed log-probs are b'f'/b'd' then float32/float64 LE values; got {len(data)} bytes "
                         f"starting {bytes(code)!r}")
    return list(struct.unpack(f"<{(len(data) - 1) // width}{code.decode()}", data[1:]))


@dataclass(slots=True)
class PackedTokens:
    """An LLM call's token arrays on their way from the adapter to a store: packed once, copied
    never. ``logprobs`` is None when the engine sent none."""

    prompt: bytes
    response: bytes
    logprobs: bytes | None = None

    @classmethod
    def of(cls, prompt: Sequence[int], response: Sequence[int], logprobs: Sequence[float] | None) -> "PackedTokens":
        return cls(pack_ids(prompt), pack_ids(response), pack_logprobs(logprobs) if logprobs is not None else None)


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
    tokens: PackedTokens | None = None


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


class PolicyRecord(_Record):
    """One publish: the served model name answered with these weights from ``time`` on."""

    served_name: str = Field(min_length=1)
    version: NonNegativeInt64
    adapter: str | None = None
    time: float = Field(default_factory=time.time)
    #: Lineage: group ids of the rollouts this version was trained on, in batch order; None when not recorded.
    trained_on: list[str] | None = None
    #: The version-specific name every serving replica serves this version under (``policy@v5``): traced calls
    #: to ``served_name`` are sent to it and stamped ``version`` (trainer_bridge/replicas.py). None: loaded in
    #: place under ``served_name`` only.
    served_as: str | None = None


class Decision(StrEnum):
    """What was decided about a served name's policy (``PolicyDecision``)."""

    EVALUATED = "evaluated"  # the gate measured a candidate beside the live policy (its figures)
    PROMOTED = "promoted"  # the candidate went live (its publish is the policy record beside it)
    REFUSED = "refused"  # the candidate was not published; the live policy stayed
    ROLLED_BACK = "rolled_back"  # an earlier version was made live again (by hand, or by the watch)
    CANARY = "canary"  # the candidate serves a share of production under its own name (figures: canary_name,
    #                    canary_share, canary_until) until the next decision about the served name


class PolicyDecision(_Record):
    """A decision about ``served_name``'s policy, kept next to its publishes (``PolicyRecord``): the gate's
    figures, a promotion, a refusal, a rollback."""

    served_name: str = Field(min_length=1)
    version: NonNegativeInt64  # the candidate judged, or the version rolled back to
    decision: Decision
    live_version: NonNegativeInt64 | None = None  # what was live when it was decided (compared with, rolled back from)
    adapter: str | None = None  # the candidate's (or the restored version's) adapter folder
    figures: dict[str, float | int | bool | str | None] = Field(default_factory=dict)  # the test's (gate_*)
    reason: str | None = None
    time: float = Field(default_factory=time.time)


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


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    name: str
    arguments: str = ""


class LLMCall(_Record):
    """One LLM request/response inside a rollout, derived from its span."""

    index: int
    span_id: str
    parent_id: str | None = None
    operation: str = "chat"
    model: str | None = None
    agent_name: str | None = None
    input_messages: list[dict[str, Any]] = Field(default_factory=list)
    output_messages: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    prompt_token_ids: list[int] = Field(default_factory=list)
    response_token_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] | None = None
    token_ids_source: TokenIdsSource = TokenIdsSource.MISSING
    policy_version: int | None = None
    #: The version live when the call ended, only when a publish landed while it ran (else None).
    policy_version_end: int | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    finish_reason: str | None = None
    streamed: bool = False
    incomplete: bool = False
    start_ns: int = 0
    end_ns: int = 0
    reward: float | None = None  # after credit assignment

    @property
    def response_text(self) -> str:
        parts = [m.get("content") or "" for m in self.output_messages]
        return "".join(p if isinstance(p, str) else "" for p in parts)


class Trajectory(_Record):
    """A rollout with its LLM calls in order and rewards after credit assignment (assembled, not stored)."""

    rollout_id: str
    name: str = ""
    task: Any = None
    group_id: str | None = None
    attempt: int = 0
    mode: Mode = Mode.TRAIN
    status: RolloutStatus
    policy_version: int | None = None
    start_time: float
    end_time: float | None = None
    error: str | None = None
    llm_calls: list[LLMCall] = Field(default_factory=list)
    rewards: list[Reward] = Field(default_factory=list)
    final_reward: float | None = None
    credit: str = "final"
    agents: list[str] = Field(default_factory=list)
    tool_spans: list[Span] = Field(default_factory=list)
    missing_token_ids: int = 0  # LLM calls recorded without engine token ids

    @property
    def total_reward(self) -> float | None:
        values = [c.reward for c in self.llm_calls if c.reward is not None]
        return math.fsum(values) if values else self.final_reward


class Sample(_Record):
    """What a trainer consumes: one LLM call, or a whole trajectory merged by exact token prefix."""

    rollout_id: str | None = None
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_logprobs: list[float] | None = None
    reward: float | None = None
    token_rewards: list[float] | None = None
    group_id: str | None = None
    agent_name: str | None = None
    #: The served model name the calls went to (under multi-LoRA serving, the LoRA's name): the
    #: policy that trains on this sample (``route_by_policy``).
    policy: str | None = None
    policy_version: int | None = None
    llm_call_indices: list[int] = Field(default_factory=list)


def allowed_from(new: RolloutStatus | str) -> frozenset[RolloutStatus]:
    """The statuses from which a rollout may move to ``new`` (from ``TRANSITIONS``)."""
    new = RolloutStatus(new)
    return frozenset(old for old, targets in TRANSITIONS.items() if new in targets)


class QueueStatus(StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"


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
