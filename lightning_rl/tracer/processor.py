"""Our private provider (``CaptureProvider``: never switched off by ``OTEL_SDK_DISABLED``, which is the user's)
and the processor that numbers each span within its rollout and hands it, finished and redacted, to the sink
(``RolloutSpanProcessor``); ``provider.py``'s ``Tracing`` holds one of each."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from ..diagnostics import count, report_failure
from ..records import PackedTokens, SpanRow
from .context import _rollout
from .records import KIND_NAMES, STATUS_NAMES
from .redaction import redact_readable
from ..sink import SpanSink


def otel_sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


class CaptureProvider(TracerProvider):
    """Our private provider. The SDK's ``TracerProvider`` reads ``OTEL_SDK_DISABLED`` when it is made and
    then hands out no-op tracers, which switched capture off without a word (rollouts read "succeeded"
    with 0 LLM calls). This one is never disabled; ``tests/tracer/test_trace.py`` holds it to that."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._disabled = False  # the SDK's own switch (read in get_tracer); the variable is the user's

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        self._disabled = False
        return super().get_tracer(*args, **kwargs)


class RolloutSpanProcessor(SpanProcessor):
    """Numbers each span within its rollout at start and sends it to the sink at end.

    ``on_end`` never raises and never blocks for long: the sink queues the row (and applies
    back-pressure only when its bounded queue is full).
    """

    def __init__(self, get_sink: Callable[[], SpanSink],
                 get_redaction: Callable[[], Callable[[str], str] | None] = lambda: None,
                 keep_tokens: Callable[[], bool] = lambda: True) -> None:
        self._get_sink = get_sink
        self._get_redaction = get_redaction
        self._keep_tokens = keep_tokens
        self._pending: dict[int, tuple] = {}
        self._tokens: dict[int, PackedTokens] = {}

    def attach_tokens(self, span: Any, tokens: PackedTokens) -> None:
        """Send ``tokens`` with ``span`` when it ends: beside its OTel attributes, never through them
        (OTel would check every element of an array attribute, one by one)."""
        span_id = span.get_span_context().span_id
        if span_id in self._pending:
            self._tokens[span_id] = tokens

    def on_start(self, span, parent_context=None) -> None:  # noqa: ANN001 (OTel signature)
        state = _rollout.get()
        if state is not None:
            self._pending[span.context.span_id] = (state.rollout_id, next(state.seq))

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.context
        entry = self._pending.pop(ctx.span_id, None)
        tokens = self._tokens.pop(ctx.span_id, None) if self._tokens else None
        try:
            redact = self._get_redaction()
            if redact is not None:  # before the user's processors (after ours) see the span, in a rollout or not
                if redact_readable(span, redact, self._keep_tokens(), tokens is not None):
                    tokens = None
        except Exception as exc:  # never into the agent
            report_failure("span redaction", exc)
            span._attributes, span._events = {}, ()  # fail closed: nothing unredacted is handed on
            tokens = None
        if entry is None:
            count("spans_outside_rollout")
            return
        try:
            parent = span.parent
            status = span.status
            events = span.events
            row = SpanRow(
                entry[0],
                entry[1],
                ctx.trace_id,
                ctx.span_id,
                parent.span_id if parent is not None else None,
                span.name,
                KIND_NAMES[span.kind],
                span.start_time,
                span.end_time,
                STATUS_NAMES[status.status_code],
                status.description,
                span.attributes,
                events if events else (),
                tokens,
            )
            self._get_sink().write_span(row)
        except Exception as exc:  # never into the agent
            report_failure("span export", exc)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self._get_sink().flush(timeout_millis / 1000)
        except Exception as exc:
            report_failure("flush", exc)
            return False
