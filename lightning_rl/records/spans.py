"""A span as recorded (``Span``, with the engine's token arrays beside its attributes: ``SpanTokens``), and
the capture hot path's plain dataclasses: ``SpanRow``, a finished span on its way from the tracer to a
store, and ``PackedTokens``, its token arrays packed once (``pack_ids``, ``pack_logprobs``) and copied never."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..boundaries import Int64
from .rollouts import _Record

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
