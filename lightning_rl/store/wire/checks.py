"""The server's checks of a parsed batch beyond its types (``check_ops``): ids, hex trace and span ids, span
kinds and status codes, token ids and finite log-probs (packed or as lists), JSON-safe attributes. Every
problem names its op as ``ops[i]``; ``op_indices`` reads those indices back from the messages."""

from __future__ import annotations

import math
import re
import struct
from typing import Any

from ... import semconv as sc
from ...boundaries import attribute_problems, json_problem
from ...records import Span
from .models import (MAX_ID_CHARS, SPAN_KINDS, STATUS_CODES, FinishRolloutOp, RewardOp, SpanOp, StartRolloutOp,
                     WireTokens)

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")


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
