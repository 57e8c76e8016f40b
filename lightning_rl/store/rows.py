"""Records <-> flat rows: one conversion shared by every store (and the spill file)."""

from __future__ import annotations

from typing import Any

import orjson

from ..diagnostics import count
from ..records import QueueEntry, Reward, Rollout, Span, SpanRow

SPAN_COLUMNS = (
    "rollout_id", "seq", "trace_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns",
    "status_code", "status_message", "attributes", "events",
)
ROLLOUT_COLUMNS = (
    "rollout_id", "name", "agent", "task", "group_id", "attempt", "mode", "status", "policy_version",
    "start_time", "end_time", "error",
)
REWARD_COLUMNS = ("rollout_id", "name", "value", "llm_call_index", "agent", "source", "time", "uid")


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        count("attributes_serialized_with_repr")
        return orjson.dumps(value, default=repr).decode()


def _events(events: Any) -> str | None:
    if not events:
        return None
    return _dumps([{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in events])


def span_values(row: SpanRow) -> tuple:
    """A finished span as the tuple stored in the ``spans`` table (JSON for attributes and events)."""
    attrs = row.attributes
    # BoundedAttributes keeps a plain dict in ``_dict``; serializing it directly skips a copy per span.
    plain = getattr(attrs, "_dict", None)
    return (
        row.rollout_id,
        row.seq,
        "%032x" % row.trace_id,
        "%016x" % row.span_id,
        None if row.parent_id is None else "%016x" % row.parent_id,
        row.name,
        row.kind,
        row.start_ns,
        row.end_ns,
        row.status_code,
        row.status_message,
        _dumps(plain if plain is not None else dict(attrs or {})),
        _events(row.events),
    )


def span_record_values(span: Span) -> tuple:
    return (
        span.rollout_id, span.seq, span.trace_id, span.span_id, span.parent_id, span.name, span.kind,
        span.start_ns, span.end_ns, span.status_code, span.status_message, _dumps(span.attributes),
        _dumps(span.events) if span.events else None,
    )


def span_from_values(values: tuple | list) -> Span:
    data = dict(zip(SPAN_COLUMNS, values))
    data["attributes"] = orjson.loads(data["attributes"])
    data["events"] = orjson.loads(data["events"]) if data["events"] else []
    return Span.model_validate(data)


def rollout_values(r: Rollout) -> tuple:
    return (
        r.rollout_id, r.name, r.agent, orjson.dumps(r.task).decode(), r.group_id, r.attempt,
        r.mode.value, r.status.value, r.policy_version, r.start_time, r.end_time, r.error,
    )


def rollout_from_values(values: tuple | list) -> Rollout:
    data = dict(zip(ROLLOUT_COLUMNS, values))
    data["task"] = orjson.loads(data["task"]) if data["task"] is not None else None
    return Rollout.model_validate(data)


def reward_values(r: Reward) -> tuple:
    return (r.rollout_id, r.name, r.value, r.llm_call_index, r.agent, r.source.value, r.time, r.uid)


def reward_from_values(values: tuple | list) -> Reward:
    return Reward.model_validate(dict(zip(REWARD_COLUMNS, values)))


QUEUE_COLUMNS = ("queue_id", "group_id", "task", "attempt", "mode", "status", "runner", "lease_expires", "tries",
                 "max_tries", "rollout_id", "outcome", "created")


def queue_values(e: QueueEntry) -> tuple:
    return (e.queue_id, e.group_id, orjson.dumps(e.task).decode(), e.attempt, e.mode.value, e.status.value, e.runner,
            e.lease_expires, e.tries, e.max_tries, e.rollout_id, e.outcome.value if e.outcome else None, e.created)


def queue_from_values(values: tuple | list) -> QueueEntry:
    data = dict(zip(QUEUE_COLUMNS, values))
    data["task"] = orjson.loads(data["task"]) if data["task"] is not None else None
    return QueueEntry.model_validate(data)
