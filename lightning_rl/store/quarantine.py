"""Records a store cannot write, described so that a store keeps them (its backend tells them apart from a
store that cannot be written).

The writer (``writer.py``) asks the backend's ``is_record_error`` (SQLite's in ``sqlite/quarantine.py``,
PostgreSQL's in ``postgres/store.py``) whether a failed batch failed for a reason in its own data. If so,
it isolates the ops that fail on their own; each is described here (:func:`describe`: a ``Quarantine`` op
with its rollout, why, and its original form as JSON text) and kept in the store's quarantine (its
``quarantine`` table, one row per :func:`digest_of`), never retried, never spilled.
"""

from __future__ import annotations

import hashlib

import orjson

from ..boundaries import int64_problem, safe_text
from . import wire
from .ops import (
    EncodedSpan,
    ExpireTry,
    FinishRollout,
    Op,
    Quarantine,
    StartRollout,
    TracedSpan,
    WriteReward,
    rollout_of,
)
from .rows import SPAN_COLUMNS

# Integer columns of a span row, by name and position.
_SPAN_INTS = {name: SPAN_COLUMNS.index(name) for name in ("seq", "start_ns", "end_ns", "prompt_base_seq", "prompt_shared",
                                                    "input_base_seq", "input_shared")}


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


def record_problem(op: Op) -> str | None:
    """The field of an op that no SQLite store can hold, named, or None if none is found."""
    kind = type(op)
    if kind is TracedSpan:
        return _first(*(int64_problem(getattr(op.row, name), f"span {name}") for name in ("seq", "start_ns", "end_ns")))
    if kind is EncodedSpan:
        return _first(*(int64_problem(op.values[i], f"span {name}") for name, i in _SPAN_INTS.items()
                        if i < len(op.values)))
    if kind is StartRollout or kind is ExpireTry:
        rollout = op.rollout if kind is StartRollout else op.tombstone
        return _first(int64_problem(rollout.attempt, "rollout attempt"),
                      int64_problem(rollout.policy_version, "rollout policy_version"))
    if kind is WriteReward:
        return int64_problem(op.reward.llm_call_index, "reward llm_call_index")
    if kind is FinishRollout:
        return int64_problem(op.policy_version, "finish policy_version")
    return None


def describe(op: Op, exc: BaseException) -> Quarantine:
    """An op the writer could not write, as its description: its rollout, why, and its original form
    (its wire JSON) or, when not even JSON can hold it, a bounded text of it."""
    reason = record_problem(op) or f"{type(exc).__name__}: {exc}"
    try:
        text = wire.encode(op).decode()
    except Exception:  # not even JSON can hold it (too deep, an integer beyond 64 bits): its description
        text = orjson.dumps({"kind": op.kind, "unencodable": safe_text(op)}).decode()
    return Quarantine(op.kind, rollout_of(op), f"{op.kind} could not be written: {reason}"[:2000], text)


def digest_of(kind: str, text: str) -> str:
    """What keeps a quarantined record once however often its batch is retried: its kind and form, hashed."""
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()
