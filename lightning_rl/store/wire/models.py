"""The wire format's types: the batch of ops a client sends (``Batch``: ``start_rollout``, ``span``, ``reward``,
``finish_rollout``), the request and response bodies of the store server's other endpoints, and the limits
(``MAX_BATCH_OPS``, ``MAX_ID_CHARS``, ...). Parsed strictly by pydantic; the rules types cannot say are in
``checks.py``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ... import semconv as sc
from ...boundaries import NonNegativeInt64
from ...records import QueueEntry, Reward, RewardSource, Rollout, RolloutStatus, Span
from ..checks import MAX_CANCEL_REASON

API_PREFIX = "/v1"
#: Ops per request the client sends, and the most the server accepts.
CLIENT_BATCH_OPS = 500
MAX_BATCH_OPS = 20_000
MAX_ID_CHARS = 256
TOKEN_ID_LIMIT = 2**31  # token ids are non-negative and fit an int32 (every tokenizer's vocab does)
SPAN_KINDS = ("INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
STATUS_CODES = ("UNSET", "OK", "ERROR")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


_TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
_LogProb = Annotated[float, Field(le=0, allow_inf_nan=False)]


def _span_attributes() -> type:
    """The attributes of a span on the wire: any keys, but the token-array keys of the conventions are
    typed, so that bad token ids (which the assembly would read as a call's tokens) are caught while the
    JSON is parsed (in pydantic-core, not in a Python loop)."""
    from typing_extensions import TypedDict

    typed = TypedDict("SpanAttributes", {  # type: ignore[misc]
        sc.PROMPT_TOKEN_IDS: list[_TokenId],
        sc.RESPONSE_TOKEN_IDS: list[_TokenId],
        sc.RESPONSE_LOGPROBS: list[_LogProb],
    }, total=False)
    typed.__pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[attr-defined]
    return typed


SpanAttributes = _span_attributes()


class WireTokens(_Wire):
    """An LLM call's token arrays as sent to the server: base64 of the packed bytes (int32 LE token
    ids; log-probs: a type byte, ``f`` or ``d``, then float32 or float64 LE values), decoded in
    pydantic-core, never element by element."""

    model_config = ConfigDict(extra="forbid", val_json_bytes="base64")
    prompt: bytes
    response: bytes
    logprobs: bytes | None = None


class WireListTokens(_Wire):
    """Token arrays as JSON lists: the shape spans are read in, also taken for writing (slower)."""

    prompt_ids: list[_TokenId]
    response_ids: list[_TokenId]
    response_logprobs: list[_LogProb] | None = None


class WireSpan(Span):
    """A span as sent to the server: :class:`Span` with ``tokens`` packed (what HttpStore sends) or
    as lists. Token arrays given as attributes are checked, and stored as the attributes they are."""

    attributes: SpanAttributes = Field(default_factory=dict)  # type: ignore[valid-type]
    tokens: WireTokens | WireListTokens | None = None  # type: ignore[assignment]


class StartRolloutOp(_Wire):
    op: Literal["start_rollout"]
    rollout: Rollout


class SpanOp(_Wire):
    op: Literal["span"]
    span: WireSpan


class RewardOp(_Wire):
    op: Literal["reward"]
    reward: Reward


class FinishRolloutOp(_Wire):
    op: Literal["finish_rollout"]
    rollout_id: str
    status: RolloutStatus
    end_time: float
    error: str | None = None
    #: The rollout's version, derived from its LLM calls when it ends (the oldest that served it).
    policy_version: NonNegativeInt64 | None = None


WireOp = Annotated[Union[StartRolloutOp, SpanOp, RewardOp, FinishRolloutOp], Field(discriminator="op")]


class Batch(_Wire):
    ops: list[WireOp] = Field(max_length=MAX_BATCH_OPS)


class BatchResult(_Wire):
    accepted: int


class RewardIn(_Wire):
    """A late reward (user feedback) for a stored rollout."""

    rollout_id: str
    value: float
    name: str = "reward"
    llm_call_index: NonNegativeInt64 | None = None
    agent: str | None = None
    source: RewardSource = RewardSource.FEEDBACK
    uid: str | None = Field(None, min_length=1, max_length=128)


class EnqueueIn(_Wire):
    task: Any = None
    n: int = Field(1, le=10_000)  # n < 1: the store says why (same message as locally)
    mode: Literal["train", "eval", "prod"] = "train"
    max_tries: int = Field(3, ge=1, le=1000)
    group_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    once: bool = False
    overrides: dict[str, Any] | None = None  # checked by the store (checks.check_overrides)


class LeaseIn(_Wire):
    runner: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    lease_seconds: float = Field(60.0, gt=0, le=86_400)
    limit: int = Field(1, ge=1, le=1000)
    key: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)  # retries of one request reuse it
    #: a long poll: answer as soon as a try can be leased, or empty after this many seconds (the server
    #: caps it at ``MAX_LEASE_WAIT``); sent only when above 0, so an older server takes the rest
    wait: float = Field(0.0, ge=0, le=300)


#: the longest a store server holds a lease request open (under every client's read timeout)
MAX_LEASE_WAIT = 20.0


class HeartbeatIn(_Wire):
    queue_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    runner: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    lease_seconds: float = Field(60.0, gt=0, le=86_400)
    #: the try the runner means: refused once the entry is another try (sent only when given)
    rollout_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)


class CompleteIn(_Wire):
    queue_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    runner: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    outcome: RolloutStatus
    rollout_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)


#: the most queue ids one cancel request names (``HttpStore.cancel`` sends more as several requests)
MAX_CANCEL_IDS = 1000


class CancelIn(_Wire):
    """``POST /v1/queue/cancel``: cancel these tries (``TaskQueue.cancel``)."""

    queue_ids: list[Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]] = Field(max_length=MAX_CANCEL_IDS)
    reason: str = Field("", max_length=MAX_CANCEL_REASON)


class Cancelled(_Wire):
    """The ids among those named that are cancelled (done and unknown ones are left out)."""

    cancelled: list[str]


class DecisionIn(_Wire):
    """A decision about ``served_name``'s policy (``records.PolicyDecision``): the gate's figures, a
    promotion, a refusal or a rollback."""

    served_name: str = Field(min_length=1, max_length=256)
    version: NonNegativeInt64
    decision: Literal["evaluated", "promoted", "refused", "rolled_back", "canary"]
    live_version: NonNegativeInt64 | None = None
    adapter: str | None = Field(None, max_length=4096)
    figures: dict[Annotated[str, Field(max_length=256)],
                  float | int | bool | Annotated[str, Field(max_length=4096)] | None] = Field(
        default_factory=dict, max_length=256)
    reason: str | None = Field(None, max_length=4096)
    time: float | None = None


class PolicyIn(_Wire):
    """A publish: ``served_name`` answers with weights ``version`` (an adapter path, if any) from now on,
    trained on the rollout groups ``trained_on``."""

    served_name: str = Field(min_length=1, max_length=256)
    version: NonNegativeInt64
    adapter: str | None = Field(None, max_length=4096)
    time: float | None = None
    # Lineage: the group ids this version was trained on, in batch order.
    trained_on: list[Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]] | None = Field(
        None, max_length=100_000)
    served_as: str | None = Field(None, min_length=1, max_length=256)  # the version's own name on every replica


class RewardedSince(_Wire):
    """Rollouts rewarded since a position, and the position to ask from next time."""

    rollout_ids: list[str]
    position: int


class GroupsIn(_Wire):
    group_ids: list[str] | None = Field(None, max_length=10_000)


class RolloutIdsIn(_Wire):
    rollout_ids: list[str] = Field(max_length=1000)


class Ok(_Wire):
    ok: bool


class DeleteRolloutsIn(_Wire):
    """``POST /v1/rollouts/delete``: erase these rollouts (``full``: rebuild the files too)."""

    rollout_ids: list[str] = Field(max_length=1000)
    full: bool = False


class Deleted(_Wire):
    deleted: int


class RolloutData(_Wire):
    rollout: Rollout
    spans: list[Span]
    rewards: list[Reward]


QUEUE_ENTRIES = TypeAdapter(list[QueueEntry])


def queue_entry_json(entry: QueueEntry) -> dict[str, Any]:
    """A queue entry as the server sends it: without ``overrides`` when it has none, so that runners of a
    lightning-rl older than the field (their records forbid unknown fields) still read every other entry."""
    return entry.model_dump(mode="json", exclude={"overrides"} if entry.overrides is None else None)


ROLLOUTS = TypeAdapter(list[Rollout])
SPANS = TypeAdapter(list[Span])
REWARDS = TypeAdapter(list[Reward])
ROLLOUT_DATA = TypeAdapter(list[RolloutData])
