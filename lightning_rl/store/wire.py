"""The store server's wire format, shared by the server (validation) and the HTTP client (encoding).

A write is a batch of ops, applied in one transaction and idempotent, so a client can retry any
batch it is unsure about:

* ``start_rollout``: inserted once per ``rollout_id`` (a repeat is ignored);
* ``span``: one row per ``(rollout_id, seq)`` (a repeat is ignored);
* ``reward``: one row per ``uid`` (a repeat is ignored);
* ``finish_rollout``: a status transition (a repeat is refused by the lifecycle rules, harmlessly).

They are the writer's own operations (``store/ops.py``) as JSON: :func:`encode` writes one (also what a
spill file holds, one per line, with two more that never travel: ``expire_try`` and ``quarantine``),
:func:`to_ops` turns a validated batch back into them, :func:`decode` reads a spill line.

Types are checked strictly (``"5"`` is not an int); :func:`check_ops` adds the rules types cannot
say (hex ids, token ids, finite log-probs, ...). Every problem is reported with its path in the batch.
"""

from __future__ import annotations

import base64
import math
import re
import struct
from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .. import semconv as sc
from ..boundaries import NonNegativeInt64, attribute_problems, json_problem
from ..records import QueueEntry, Reward, RewardSource, Rollout, RolloutStatus, Span
from .ops import EncodedSpan, ExpireTry, FinishRollout, Op, Quarantine, StartRollout, TracedSpan, WriteReward
from .rows import OTEL_COLUMNS, span_record_values, span_values, with_messages

API_PREFIX = "/v1"
#: Ops per request the client sends, and the most the server accepts.
CLIENT_BATCH_OPS = 500
MAX_BATCH_OPS = 20_000
MAX_ID_CHARS = 256
TOKEN_ID_LIMIT = 2**31  # token ids are non-negative and fit an int32 (every tokenizer's vocab does)
SPAN_KINDS = ("INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
STATUS_CODES = ("UNSET", "OK", "ERROR")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")


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


class CompleteIn(_Wire):
    queue_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    runner: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    outcome: RolloutStatus


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


# -- semantic checks (server side) ------------------------------------------------------------------
def _check_id(value: str, path: str, errors: list[str]) -> None:
    if not value or len(value) > MAX_ID_CHARS:
        errors.append(f"{path}: must be 1 to {MAX_ID_CHARS} characters, got {len(value)}")


def _check_span(span: Span, path: str, errors: list[str]) -> None:
    _check_id(span.rollout_id, f"{path}.rollout_id", errors)
    if span.seq < 0:
        errors.append(f"{path}.seq: must be >= 0, got {span.seq}")
    if not _HEX32.fullmatch(span.trace_id):
        errors.append(f"{path}.trace_id: must be 32 lowercase hex digits, got {span.trace_id!r:.60}")
    if not _HEX16.fullmatch(span.span_id):
        errors.append(f"{path}.span_id: must be 16 lowercase hex digits, got {span.span_id!r:.60}")
    if span.parent_id is not None and not _HEX16.fullmatch(span.parent_id):
        errors.append(f"{path}.parent_id: must be 16 lowercase hex digits or null, got {span.parent_id!r:.60}")
    if not span.name:
        errors.append(f"{path}.name: must not be empty")
    if span.kind not in SPAN_KINDS:
        errors.append(f"{path}.kind: must be one of {', '.join(SPAN_KINDS)}, got {span.kind!r:.60}")
    if span.status_code not in STATUS_CODES:
        errors.append(f"{path}.status_code: must be one of {', '.join(STATUS_CODES)}, got {span.status_code!r:.60}")
    if not 0 <= span.start_ns <= span.end_ns:
        errors.append(f"{path}: need 0 <= start_ns <= end_ns, got {span.start_ns} and {span.end_ns}")
    attrs = span.attributes  # token ids and log-probs were type-checked while parsing
    problem = json_problem(attrs, f"{path}.attributes")
    if problem:
        errors.append(problem)
    else:
        errors.extend(attribute_problems(attrs, f"{path}.attributes"))
    if span.events:
        problem = json_problem(span.events, f"{path}.events")
        if problem:
            errors.append(problem)
    logprobs, response = attrs.get(sc.RESPONSE_LOGPROBS), attrs.get(sc.RESPONSE_TOKEN_IDS)
    if logprobs is not None and response is not None and len(logprobs) != len(response):
        errors.append(f"{path}.attributes[{sc.RESPONSE_LOGPROBS!r}]: {len(logprobs)} log-probs for "
                      f"{len(response)} response tokens")
    tokens = span.tokens
    if isinstance(tokens, WireTokens):
        _check_tokens(tokens, path, errors)
    elif tokens is not None and tokens.response_logprobs is not None \
            and len(tokens.response_logprobs) != len(tokens.response_ids):
        errors.append(f"{path}.tokens.response_logprobs: {len(tokens.response_logprobs)} log-probs for "
                      f"{len(tokens.response_ids)} response tokens")


_LOGPROB_WIDTH = {b"f": 4, b"d": 8}
_NON_NEGATIVE = bytes(range(128))  # the high byte of a non-negative int32 (LE) is one of these


def _check_ids(data: bytes, path: str, field: str, errors: list[str]) -> int:
    if len(data) % 4:
        errors.append(f"{path}.tokens.{field}: packed token ids are 4 bytes each (int32 LE), got {len(data)} bytes")
        return -1
    if data[3::4].translate(None, _NON_NEGATIVE):
        errors.append(f"{path}.tokens.{field}: token ids must be >= 0 (int32 LE); a negative one was sent")
    return len(data) // 4


def _check_tokens(tokens: WireTokens, path: str, errors: list[str]) -> None:
    """``path`` is the span's; messages name the field (error strings are built only on errors)."""
    _check_ids(tokens.prompt, path, "prompt", errors)
    n = _check_ids(tokens.response, path, "response", errors)
    data = tokens.logprobs
    if data is None:
        return
    code = data[:1]
    width = _LOGPROB_WIDTH.get(code)
    if width is None or (len(data) - 1) % width:
        errors.append(f"{path}.tokens.logprobs: packed log-probs are a type byte (f or d) then float32/float64 LE values, "
                      f"got {len(data)} bytes starting {bytes(code)!r}")
        return
    values = struct.unpack(f"<{(len(data) - 1) // width}{code.decode()}", data[1:])
    if n >= 0 and len(values) != n:
        errors.append(f"{path}.tokens.logprobs: {len(values)} log-probs for {n} response tokens")
    # A finite sum means every value is finite (one C loop); only when it is not, look value by value
    # (a sum can also overflow, or be inf - inf).
    finite = math.isfinite(sum(values)) or all(map(math.isfinite, values))
    if not finite or (values and max(values) > 0):
        errors.append(f"{path}.tokens.logprobs: log-probs must be finite and <= 0")


def check_ops(ops: list[Any]) -> tuple[list[str], set[str], set[str], dict[int, str]]:
    """Rules beyond types. Returns (errors, rollout ids started here, rollout ids referred to, and for
    the rollout id each op refers to, by its index). Every error names its op as ``ops[i]``."""
    errors: list[str] = []
    started: set[str] = set()
    referred: set[str] = set()
    refers: dict[int, str] = {}
    for i, op in enumerate(ops):
        path = f"ops[{i}]"
        if isinstance(op, SpanOp):
            _check_span(op.span, f"{path}.span", errors)
            refers[i] = op.span.rollout_id
        elif isinstance(op, StartRolloutOp):
            r = op.rollout
            _check_id(r.rollout_id, f"{path}.rollout.rollout_id", errors)
            if r.attempt < 0:
                errors.append(f"{path}.rollout.attempt: must be >= 0, got {r.attempt}")
            if not math.isfinite(r.start_time):
                errors.append(f"{path}.rollout.start_time: must be a finite UNIX time")
            problem = json_problem(r.task, f"{path}.rollout.task")
            if problem:
                errors.append(problem)
            started.add(r.rollout_id)
        elif isinstance(op, RewardOp):
            if op.reward.llm_call_index is not None and op.reward.llm_call_index < 0:
                errors.append(f"{path}.reward.llm_call_index: must be >= 0, got {op.reward.llm_call_index}")
            if not math.isfinite(op.reward.time):
                errors.append(f"{path}.reward.time: must be a finite UNIX time")
            refers[i] = op.reward.rollout_id
        elif isinstance(op, FinishRolloutOp):
            if not op.status.finished:
                errors.append(f"{path}.status: a rollout finishes as succeeded, failed or timed_out, got {op.status.value!r}")
            if not math.isfinite(op.end_time):
                errors.append(f"{path}.end_time: must be a finite UNIX time")
            refers[i] = op.rollout_id
    referred.update(refers.values())
    return errors, started, referred, refers


_OP_INDEX = re.compile(r"ops\[(\d+)\]")


def op_indices(messages: list[str]) -> list[int]:
    """The ops that error messages name (``ops[i]...``), in order, each once."""
    return sorted({int(m.group(1)) for text in messages for m in [_OP_INDEX.match(text)] if m})


class ExpireTryOp(_Wire):
    """The queue gave up on a try (spill files only: a store server expires tries itself)."""

    op: Literal["expire_try"]
    rollout: Rollout


class QuarantineOp(_Wire):
    """A record kept as its description (spill files only)."""

    op: Literal["quarantine"]
    what: str
    rollout_id: str | None = None
    reason: str
    payload: str


SpillOp = Annotated[Union[StartRolloutOp, SpanOp, RewardOp, FinishRolloutOp, ExpireTryOp, QuarantineOp],
                    Field(discriminator="op")]
SPILL_LINE = TypeAdapter(SpillOp)


def to_ops(ops: list[Any]) -> list[Op]:
    """Validated wire ops as the writer's ops (spans as ``spans`` rows, JSON encoded once, here)."""
    out: list[Op] = []
    for op in ops:
        kind = type(op)
        if kind is SpanOp:
            out.append(EncodedSpan(span_record_values(op.span)))
        elif kind is StartRolloutOp:
            out.append(StartRollout(op.rollout))
        elif kind is RewardOp:
            out.append(WriteReward(op.reward))
        elif kind is FinishRolloutOp:
            out.append(FinishRollout(op.rollout_id, op.status, op.end_time, op.error, op.policy_version))
        elif kind is ExpireTryOp:
            out.append(ExpireTry(op.rollout))
        else:
            out.append(Quarantine(op.what, op.rollout_id, op.reason, op.payload))
    return out


def decode(line: bytes) -> Op:
    """A spill-file line as the op it holds; ValueError, naming what is wrong, for a line that is not one."""
    try:
        return to_ops([SPILL_LINE.validate_json(line, strict=True)])[0]
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise ValueError(f"not an op this version writes ({'.'.join(str(p) for p in first['loc']) or 'line'}: "
                         f"{first['msg']})") from None


# -- encoding (client side): one JSON line per op, also the spill file's format ----------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


_BLOBS = slice(len(OTEL_COLUMNS) + 2, len(OTEL_COLUMNS) + 5)  # prompt, response, log-probs (packed)


def _span(values: tuple) -> bytes:
    """A ``spans`` row (whole prompts and messages) as a span op: the attributes and events JSON is
    embedded as is (``orjson.Fragment``), not parsed and dumped again; token arrays go as base64."""
    span = dict(zip(OTEL_COLUMNS, values))
    span["attributes"] = orjson.Fragment(with_messages(span["attributes"], values[-2], values[-1]))
    span["events"] = orjson.Fragment(span["events"]) if span["events"] else []
    prompt, response, logprobs = values[_BLOBS]
    if prompt is not None:
        span["tokens"] = {"prompt": _b64(prompt), "response": _b64(response),
                          "logprobs": _b64(logprobs) if logprobs is not None else None}
    return orjson.dumps({"op": "span", "span": span})


_ENCODERS = {
    TracedSpan: lambda op: _span(span_values(op.row)),
    EncodedSpan: lambda op: _span(op.values),
    StartRollout: lambda op: orjson.dumps({"op": "start_rollout", "rollout": op.rollout.model_dump(mode="json")}),
    WriteReward: lambda op: orjson.dumps({"op": "reward", "reward": op.reward.model_dump(mode="json")}),
    FinishRollout: lambda op: orjson.dumps({
        "op": "finish_rollout", "rollout_id": op.rollout_id, "status": RolloutStatus(op.status).value,
        "end_time": op.end_time, "error": op.error, "policy_version": op.policy_version}),
    ExpireTry: lambda op: orjson.dumps({"op": "expire_try", "rollout": op.tombstone.model_dump(mode="json")}),
    Quarantine: lambda op: orjson.dumps({"op": "quarantine", "what": op.what, "rollout_id": op.rollout_id,
                                         "reason": op.reason, "payload": op.payload}),
}


def encode(op: Op) -> bytes:
    """One op as its JSON line (raises TypeError for a value JSON cannot hold)."""
    return _ENCODERS[type(op)](op)


def batch_body(ops: list[bytes]) -> bytes:
    return b'{"ops":[' + b",".join(ops) + b"]}"
