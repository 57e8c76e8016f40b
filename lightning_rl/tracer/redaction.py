"""Redaction: the user's ``fn(text) -> text`` applied to every text lightning-rl records, before the record
reaches anything (issue 36; ``docs/privacy.md``).

Where: at the two doors every record passes on its way out of the tracer, and nowhere else:

* a finished span: :func:`redact_row` as a ``SpanRow`` is made for the sink (``Tracing._write_span`` for
  our own span records; ``RolloutSpanProcessor.on_end`` for SDK spans, where the span handed on to the
  user's span processors is redacted in place first: ours is the provider's first processor; the
  gateway's spans from an agent's OpenTelemetry SDK, ``Rollouts._write_external``);
* a rollout: :func:`redact_rollout` (its task) and :func:`redact_text` (its error) where it is started
  and finished (``@trace``; the gateway's rollouts).

So the store, a spill file, the HTTP store and the user's exporters all get the same redacted record,
whatever adapter or framework produced it: adapters only set span attributes.

What: every string attribute but the names and ids (:data:`KEPT`, and our ``lightning_rl.*`` namespace),
each element of a string array, the messages (their JSON is walked: each content text and each tool
call's arguments string is redacted, roles, names, types and ids stay), exception messages and
tracebacks in events, the status description, the task's strings (its keys stay), the rollout's error.

Token ids: a call whose text redaction changed keeps or drops its engine token ids and log-probs by
``settings.redacted_tokens`` (``drop`` by default: the ids decode to the original text). A redaction
that failed always drops them. Failures (the function raised, or returned no str) fail closed: the text
becomes :data:`FAILED`, counted as ``redaction_failed`` and logged once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson
from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Status

from .. import semconv
from ..diagnostics import count, report_failure
from ..records import Rollout, SpanRow

#: What a text becomes when the redaction function raised or returned something other than a str.
FAILED = "[redaction failed]"
#: Set (True) on a span whose text redaction changed; its token ids were dropped unless ``keep``.
REDACTED = "lightning_rl.redacted"

#: Attribute keys whose string values are names, ids or enums: never redacted.
KEPT = frozenset({
    semconv.GEN_AI_OPERATION_NAME, semconv.GEN_AI_PROVIDER_NAME, semconv.GEN_AI_REQUEST_MODEL,
    semconv.GEN_AI_RESPONSE_ID, semconv.GEN_AI_RESPONSE_MODEL, semconv.GEN_AI_RESPONSE_FINISH_REASONS,
    semconv.GEN_AI_AGENT_NAME, semconv.GEN_AI_TOOL_NAME, semconv.GEN_AI_TOOL_CALL_ID,
    semconv.GEN_AI_EVALUATION_NAME, semconv.GEN_AI_TOOL_DEFINITIONS, semconv.SERVER_ADDRESS,
    "gen_ai.system", "gen_ai.agent.id", "gen_ai.conversation.id", "gen_ai.output.type", "gen_ai.tool.type",
    "exception.type", "exception.escaped",
})
_OURS = "lightning_rl."
#: JSON text of messages (or instructions): walked, so roles, names and ids stay and the JSON stays JSON.
MESSAGES = frozenset({semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES, "gen_ai.system_instructions"})
#: Fields inside a message whose string values are names, ids or enums.
MESSAGE_KEPT = frozenset({"role", "name", "type", "id", "tool_call_id", "tool_use_id", "call_id", "finish_reason",
                          "mime_type", "modality"})
#: Token arrays as attributes (an agent's OTLP spans may carry them): dropped with the call's tokens.
TOKEN_KEYS = frozenset({semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS})


class Pass:
    """One record's redaction: applies ``fn`` and remembers whether any text changed or failed."""

    __slots__ = ("fn", "changed", "failed")

    def __init__(self, fn: Callable[[str], str]) -> None:
        self.fn, self.changed, self.failed = fn, False, False

    def text(self, value: str) -> str:
        try:
            out = self.fn(value)
        except Exception as exc:  # never into the agent, never the text unredacted
            self._fail(f"raised {type(exc).__name__}", exc)
            return FAILED
        if not isinstance(out, str):
            self._fail(f"returned {type(out).__name__}, not str", None)
            return FAILED
        if out != value:
            self.changed = True
        return out

    def _fail(self, what: str, exc: BaseException | None) -> None:
        self.changed = self.failed = True
        count("redaction_failed")
        report_failure(f"redaction {what}", exc, message=(
            f"lightning-rl: the redaction function {getattr(self.fn, '__qualname__', repr(self.fn))[:80]} {what}; the "
            f"text is recorded as {FAILED!r} (never unredacted) and the call's token ids are dropped. Make it a "
            "function of one str that returns a str and never raises (counted as redaction_failed, logged once)"))

    def json_value(self, value: Any, key: Any = None, kept: frozenset[str] = MESSAGE_KEPT) -> Any:
        """A JSON value with its strings redacted, but those under a ``kept`` key; keys stay."""
        if isinstance(value, str):
            return value if key in kept else self.text(value)
        if isinstance(value, dict):
            return {k: self.json_value(v, k, kept) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.json_value(v, key, kept) for v in value]
        return value

    def messages(self, value: str) -> str:
        try:
            parsed = orjson.loads(value)
        except orjson.JSONDecodeError:
            return self.text(value)
        if not isinstance(parsed, (list, dict)):
            return self.text(value)
        return orjson.dumps(self.json_value(parsed)).decode()

    def attributes(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in attributes.items():
            if key in KEPT or (key.startswith(_OURS) and key not in TOKEN_KEYS):
                out[key] = value
            elif isinstance(value, str):
                out[key] = self.messages(value) if key in MESSAGES else self.text(value)
            elif isinstance(value, (tuple, list)) and any(isinstance(v, str) for v in value):
                out[key] = tuple(self.text(v) if isinstance(v, str) else v for v in value)
            else:
                out[key] = value
        return out

    def events(self, events: Any) -> tuple[Event, ...]:
        return tuple(Event(e.name, self.attributes(e.attributes or {}), e.timestamp) for e in events)

    def description(self, text: str | None) -> str | None:
        return self.text(text) if text else text


def _drops_tokens(p: Pass, attributes: dict[str, Any], had_tokens: bool, keep: bool) -> bool:
    """Mark a span whose text changed; whether its token ids go (counted when it had some)."""
    if not p.changed:
        return False
    attributes[REDACTED] = True
    if keep and not p.failed:
        return False
    dropped = had_tokens or any(k in attributes for k in TOKEN_KEYS)
    for key in TOKEN_KEYS:
        attributes.pop(key, None)
    if dropped or attributes.get(semconv.TOKEN_IDS_SOURCE) not in (None, semconv.SOURCE_MISSING):
        attributes[semconv.TOKEN_IDS_SOURCE] = semconv.SOURCE_MISSING
        count("redacted_token_ids_dropped")
    return True


def redact_row(row: SpanRow, fn: Callable[[str], str], keep_tokens: bool) -> SpanRow:
    """``row`` with its text redacted (a new row; the span's own attributes are not changed)."""
    p = Pass(fn)
    attributes = p.attributes(row.attributes)
    events = p.events(row.events) if row.events else row.events
    status_message = p.description(row.status_message)
    tokens = None if _drops_tokens(p, attributes, row.tokens is not None, keep_tokens) else row.tokens
    return SpanRow(row.rollout_id, row.seq, row.trace_id, row.span_id, row.parent_id, row.name, row.kind,
                   row.start_ns, row.end_ns, row.status_code, status_message, attributes, events, tokens)


def redact_readable(span: Any, fn: Callable[[str], str], keep_tokens: bool, had_tokens: bool) -> bool:
    """Redact an SDK ``ReadableSpan`` in place, before any processor after ours sees it (the user's).
    Returns whether its token ids must go."""
    p = Pass(fn)
    attributes = p.attributes(span.attributes)
    events = p.events(span.events)
    status = span.status
    if status.description:
        status = Status(status.status_code, p.description(status.description))
    drop = _drops_tokens(p, attributes, had_tokens, keep_tokens)
    span._attributes, span._events, span._status = attributes, events, status  # a fresh copy per span end
    return drop


def redact_rollout(rollout: Rollout, fn: Callable[[str], str]) -> Rollout:
    """A copy of ``rollout`` with its task's strings and its error redacted (names and ids stay)."""
    p = Pass(fn)
    update: dict[str, Any] = {"task": p.json_value(rollout.task, kept=frozenset())}  # a task's "name" is data
    if rollout.error:
        update["error"] = p.text(rollout.error)
    return rollout.model_copy(update=update)


def redact_text(text: str | None, fn: Callable[[str], str] | None) -> str | None:
    """One text (a rollout's error) redacted, or as it is when there is no function or no text."""
    return Pass(fn).text(text) if fn is not None and text else text
