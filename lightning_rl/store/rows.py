"""Records <-> flat rows: one conversion shared by every store (and the wire, which sends rows as spans)."""

from __future__ import annotations

from typing import Any

import orjson

from .. import semconv
from ..boundaries import storable
from ..diagnostics import count, report_failure
from ..records import (
    SCHEMA_VERSION,
    PackedTokens,
    PolicyDecision,
    QueueEntry,
    Reward,
    Rollout,
    Span,
    SpanRow,
    SpanTokens,
    unpack_ids,
    unpack_logprobs,
)
from .tokens import TEXT_COLUMNS, TOKEN_COLUMNS, PromptResolver

OTEL_COLUMNS = (
    "rollout_id", "seq", "trace_id", "span_id", "parent_id", "name", "kind", "start_ns", "end_ns",
    "status_code", "status_message", "attributes", "events",
)
SPAN_COLUMNS = OTEL_COLUMNS + TOKEN_COLUMNS + TEXT_COLUMNS
_NO_TOKENS = (None, None, None, None, None)
_NO_TEXT = (None, None, None, None)
_INPUT, _OUTPUT = semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES
#: Token arrays as span attributes: how stores of schema 4 held them (migration 5 packs them into columns).
TOKEN_ATTRIBUTES = (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS)
ROLLOUT_COLUMNS = (
    "rollout_id", "name", "agent", "task", "group_id", "attempt", "mode", "status", "policy_version",
    "start_time", "end_time", "error", "origin",
)
REWARD_COLUMNS = ("rollout_id", "name", "value", "llm_call_index", "agent", "source", "time", "uid")
DECISION_COLUMNS = ("served_name", "version", "decision", "live_version", "adapter", "figures", "reason", "time")


def decision_values(record: PolicyDecision) -> tuple:
    """A decision as its row (``DECISION_COLUMNS``; the figures as JSON text)."""
    return (record.served_name, record.version, record.decision.value, record.live_version, record.adapter,
            orjson.dumps(record.figures).decode(), record.reason, record.time)


def decision_from_row(row: Any) -> PolicyDecision:
    values = dict(zip(DECISION_COLUMNS, row))
    values["figures"] = orjson.loads(values["figures"]) if values["figures"] else {}
    return PolicyDecision(**values)


def _dumps(value: Any) -> str:
    """JSON text of attributes or events; what JSON cannot hold (an object, an integer beyond 64 bits, a
    value nested too deep) is stored in its safe form (``boundaries.storable``) and counted."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        count("attributes_made_storable")
        return orjson.dumps(storable(value)).decode()


def _events(events: Any) -> str | None:
    if not events:
        return None
    return _dumps([{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in events])


def token_values(tokens: PackedTokens | None) -> tuple:
    """The token columns of a span row holding whole prompts (the writer's PrefixSharer shortens them)."""
    if tokens is None:
        return _NO_TOKENS
    return (None, 0, tokens.prompt, tokens.response, tokens.logprobs)


def lift_messages(attributes: Any, owned: bool = False) -> tuple[Any, tuple]:
    """Attributes without the input/output messages' JSON text, and the text columns of the row that
    hold them instead (stored once, not escaped inside the attributes' JSON, prefix-shared by the
    writer). A value that is not text stays where it was. ``owned``: ``attributes`` is a dict of our
    own that may be changed in place (else it is copied)."""
    inp, out = attributes.get(_INPUT), attributes.get(_OUTPUT)
    if type(inp) is not str:
        inp = None
    if type(out) is not str:
        out = None
    if inp is None and out is None:
        return attributes, _NO_TEXT
    rest = attributes if owned else dict(attributes)
    if inp is not None:
        del rest[_INPUT]
    if out is not None:
        del rest[_OUTPUT]
    return rest, (None, None, inp, out)


def with_messages(attributes_json: str, input_messages: str | None, output_messages: str | None) -> str:
    """The attributes' JSON text with the messages put back as the string attributes they were (the
    HTTP wire sends whole attributes), without parsing it again."""
    extra = b"".join(orjson.dumps(key) + b":" + orjson.dumps(value) + b","
                     for key, value in ((_INPUT, input_messages), (_OUTPUT, output_messages)) if value is not None)
    if not extra:
        return attributes_json
    body = attributes_json[1:-1]
    return "{" + extra.decode() + body + "}" if body else "{" + extra[:-1].decode() + "}"


def lift_token_attributes(attributes: dict[str, Any]) -> tuple[dict[str, Any], PackedTokens | None]:
    """Attributes without the token-array keys, and those arrays packed (None if absent or not packable)."""
    if not any(k in attributes for k in TOKEN_ATTRIBUTES):
        return attributes, None
    rest = {k: v for k, v in attributes.items() if k not in TOKEN_ATTRIBUTES}
    prompt, response = attributes.get(semconv.PROMPT_TOKEN_IDS), attributes.get(semconv.RESPONSE_TOKEN_IDS)
    if prompt is None or response is None:  # half a pair cannot make a sample: kept as it was
        return attributes, None
    try:
        return rest, PackedTokens.of(prompt, response, attributes.get(semconv.RESPONSE_LOGPROBS))
    except (OverflowError, TypeError, ValueError):  # not int32 ids / not numbers: kept as they were
        count("token_attributes_not_packed")
        return attributes, None


def span_values(row: SpanRow) -> tuple:
    """A finished span as the tuple stored in the ``spans`` table (JSON for attributes and events,
    packed bytes for token arrays)."""
    attrs = row.attributes
    # BoundedAttributes keeps a plain dict in ``_dict``; serializing it directly skips a copy per span.
    plain = getattr(attrs, "_dict", None)
    attrs, text = lift_messages(plain if plain is not None else attrs or {})
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
        _dumps(attrs if type(attrs) is dict else dict(attrs)),
        _events(row.events),
        *token_values(row.tokens),
        *text,
    )


def span_record_values(span: Span) -> tuple:
    """A :class:`Span` record (ingested, or a validated wire span) as a ``spans`` row: its tokens as
    lists (``SpanTokens``) or already packed (the wire's). Its attributes are stored as they are."""
    attributes, text = lift_messages(span.attributes)
    t = span.tokens
    packed = None
    if t is None:
        pass
    elif "prompt_ids" in type(t).model_fields:  # lists (SpanTokens, or the wire's list form)
        packed = PackedTokens.of(t.prompt_ids, t.response_ids, t.response_logprobs)
    else:  # the wire's packed form, checked by wire.check_ops
        packed = PackedTokens(t.prompt, t.response, t.logprobs)
    return (
        span.rollout_id, span.seq, span.trace_id, span.span_id, span.parent_id, span.name, span.kind,
        span.start_ns, span.end_ns, span.status_code, span.status_message, _dumps(attributes),
        _dumps(span.events) if span.events else None, *token_values(packed), *text,
    )


def span_from_values(values: tuple | list, resolver: PromptResolver | None = None) -> Span:
    """A stored row as a :class:`Span`. Rows are this store's own (its schema is migrated on open):
    they are built, not validated again. Rows of one rollout go through one ``resolver``, in seq order."""
    (rollout_id, seq, trace_id, span_id, parent_id, name, kind, start_ns, end_ns, status_code, status_message,
     attributes, events, base, shared, prompt, response, logprobs, in_base, in_shared, inp, out) = values
    tokens = None
    if prompt is not None:
        if base is not None or resolver is not None:
            prompt = (resolver or PromptResolver()).resolve(seq, base, shared or 0, prompt, response)
        if prompt is not None:
            tokens = SpanTokens.model_construct(
                prompt_ids=unpack_ids(prompt), response_ids=unpack_ids(response),
                response_logprobs=unpack_logprobs(logprobs) if logprobs is not None else None)
    attributes = orjson.loads(attributes)
    if inp is not None:
        if in_base is not None or resolver is not None:
            inp = (resolver or PromptResolver()).resolve_text(seq, in_base, in_shared or 0, inp, out)
        if inp is not None:
            attributes[_INPUT] = inp
    if out is not None:
        attributes[_OUTPUT] = out
    return Span.model_construct(
        schema_version=SCHEMA_VERSION, rollout_id=rollout_id, seq=seq, trace_id=trace_id, span_id=span_id, parent_id=parent_id,
        name=name, kind=kind, start_ns=start_ns, end_ns=end_ns, status_code=status_code,
        status_message=status_message, attributes=attributes,
        events=orjson.loads(events) if events else [], tokens=tokens)


def spans_from_rows(rows: list[tuple]) -> list[Span]:
    """One rollout's rows (in seq order) as spans, with prefix-shared prompts made whole. A row that
    cannot be read (JSON or packed columns written by another version) is skipped and counted."""
    resolver = PromptResolver()
    spans = []
    for row in rows:
        try:
            spans.append(span_from_values(row, resolver))
        except Exception as exc:  # one row must not hide the rollout's others, nor fail a listing
            _unreadable("span", row[0] if row else None, exc)
    return spans


def _unreadable(kind: str, rollout_id: Any, exc: BaseException) -> None:
    count(f"{kind}_rows_unreadable")
    report_failure(f"unreadable {kind} row", message=(
        f"lightning-rl: a stored {kind} row (rollout {str(rollout_id)[:80]!r}) could not be read "
        f"({type(exc).__name__}: {str(exc)[:200]}); it is skipped and counted ({kind}_rows_unreadable). "
        "It was written by another version or changed by hand: `lightning-rl store doctor` lists the counts"))


def rollouts_from_rows(rows: list[tuple]) -> list[Rollout]:
    """Rollout rows as records; a row that is not a valid rollout is skipped and counted."""
    found = []
    for row in rows:
        try:
            found.append(rollout_from_values(row))
        except Exception as exc:
            _unreadable("rollout", row[0] if row else None, exc)
    return found


def rollout_values(r: Rollout) -> tuple:
    return (
        r.rollout_id, r.name, r.agent, orjson.dumps(r.task).decode(), r.group_id, r.attempt,
        r.mode.value, r.status.value, r.policy_version, r.start_time, r.end_time, r.error, r.origin,
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
                 "max_tries", "rollout_id", "outcome", "created", "lease_key", "overrides")


def queue_values(e: QueueEntry) -> tuple:
    return (e.queue_id, e.group_id, orjson.dumps(e.task).decode(), e.attempt, e.mode.value, e.status.value, e.runner,
            e.lease_expires, e.tries, e.max_tries, e.rollout_id, e.outcome.value if e.outcome else None, e.created,
            e.lease_key, orjson.dumps(e.overrides).decode() if e.overrides is not None else None)


def queue_from_values(values: tuple | list) -> QueueEntry:
    data = dict(zip(QUEUE_COLUMNS, values))
    data["task"] = orjson.loads(data["task"]) if data["task"] is not None else None
    data["overrides"] = orjson.loads(data["overrides"]) if data["overrides"] is not None else None
    return QueueEntry.model_validate(data)
