"""The writer's ops (``store/ops.py``) as JSON lines and back: ``encode`` writes one (what the HTTP client sends,
and what a spill file holds, with two ops that never travel: ``expire_try`` and ``quarantine``),
``batch_body`` joins them into a request, ``to_ops`` turns a validated batch back into ops, ``decode``
reads a spill line."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from ...records import Rollout, RolloutStatus
from ..ops import EncodedSpan, ExpireTry, FinishRollout, Op, Quarantine, StartRollout, TracedSpan, WriteReward
from ..rows import OTEL_COLUMNS, span_record_values, span_values, with_messages
from .models import FinishRolloutOp, RewardOp, SpanOp, StartRolloutOp, _Wire


# -- the spill file's two ops of its own -------------------------------------------------------------
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
