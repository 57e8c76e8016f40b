"""Spans recorded without an OpenTelemetry SDK span, when nobody but the store listens (issue 33).

Capture needs what a span records (ids, parent, name, kind, times, status, attributes, events) and a
row in the store; it does not need the SDK's machinery around it (a span processor chain, per-value
attribute validation, locks, ``BoundedAttributes``). So while no user span processor is configured
(``configure(span_processors=...)``), :class:`RecordTracer` hands out :class:`RecordSpan`: a span of
the OpenTelemetry *API* (so ``use_span``, context propagation and parenting work for every tracer in
the process, ours and the user's), numbered within its rollout when it starts and sent to the sink as
a :class:`SpanRow` when it ends, exactly what the SDK path sends. Once someone listens, the tracer is
the SDK's and they get complete SDK spans; ``tests/tracer/test_record_spans.py`` holds both paths to
the same stored rows.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from ..diagnostics import count, report_failure
from ..records import PackedTokens, SpanRow
from .context import _rollout

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
KIND_NAMES = {kind: kind.name for kind in SpanKind}  # Enum.name is a slow descriptor
STATUS_NAMES = {code: code.name for code in StatusCode}
_UNSET = Status(StatusCode.UNSET)
_SCALARS = (str, bool, int, float)
_SCALAR_TYPES = frozenset(_SCALARS)


def _kind(value: Any) -> type | None:
    """Which of str, bool, int, float ``value`` is (a subclass counts: smolagents' AgentText is a str), or None."""
    for kind in (bool, str, int, float):  # bool before int: an int attribute list may not hold a bool
        if isinstance(value, kind):
            return kind
    return None


def _valid(value: Any) -> bool:
    """What an OpenTelemetry attribute may hold, as the SDK checks it: a str, bool, int or float (or a subclass),
    or a sequence of one of them."""
    if type(value) in _SCALARS or _kind(value) is not None:
        return True
    if type(value) in (tuple, list) or (isinstance(value, Sequence) and not isinstance(value, bytes)):
        kinds = {_kind(v) for v in value if v is not None}
        return len(kinds) <= 1 and None not in kinds
    return False


def _attribute_dropped(key: Any, value: Any) -> None:
    count("span_attributes_dropped")
    report_failure("span attribute dropped", message=(
        f"lightning-rl: span attribute {str(key)[:80]!r} was given a {type(value).__name__}, which an OpenTelemetry "
        "attribute cannot hold (str, bool, int, float or a list of one of them); it is left out, as the OpenTelemetry "
        "SDK does (counted as span_attributes_dropped, logged once)"))


class _Event:
    __slots__ = ("name", "attributes", "timestamp")

    def __init__(self, name: str, attributes: Mapping[str, Any] | None, timestamp: int) -> None:
        self.name, self.attributes, self.timestamp = name, attributes, timestamp


class RecordSpan(otel_trace.Span):
    """One span of ours, recorded straight to the sink when it ends (see the module's docstring)."""

    __slots__ = ("_trace_id", "_span_id", "_trace_state", "_context", "_parent_id", "name", "kind", "start_time",
                 "end_time", "attributes", "_events", "_status", "_rollout_id", "_seq", "tokens", "_write")

    def __init__(self, name: str, trace_id: int, span_id: int, trace_state: Any, parent_id: int | None,
                 kind: SpanKind, start_time: int, attributes: dict[str, Any], write: Callable[[SpanRow], None]) -> None:
        self._trace_id, self._span_id, self._trace_state = trace_id, span_id, trace_state
        self._context: SpanContext | None = None  # made when asked for (a leaf span never is)
        self._parent_id, self.name, self.kind = parent_id, name, kind
        self.start_time, self.end_time, self.attributes = start_time, None, attributes
        self._events: list[_Event] = []
        self._status = _UNSET
        self.tokens: PackedTokens | None = None  # sent beside the attributes, never through them
        self._write = write
        state = _rollout.get()
        if state is None:
            self._rollout_id, self._seq = None, 0
        else:
            self._rollout_id, self._seq = state.rollout_id, next(state.seq)

    # -- the OpenTelemetry Span API ---------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        if self._context is None:
            self._context = SpanContext(self._trace_id, self._span_id, False, _SAMPLED, self._trace_state)
        return self._context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is not None or value is None:
            return
        if _valid(value):
            self.attributes[key] = tuple(value) if type(value) is list else value
        else:
            _attribute_dropped(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.end_time is not None:
            return
        own = self.attributes
        if _SCALAR_TYPES.issuperset(map(type, attributes.values())):  # the usual case: one check for them all
            own.update(attributes)
            return
        for key, value in attributes.items():
            if type(value) in _SCALARS:
                own[key] = value
            else:
                self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if self.end_time is None:
            self._events.append(_Event(name, dict(attributes or {}), timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        pass  # links are not recorded by the store (nor were they with the SDK span)

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None or self._status.status_code is StatusCode.OK:  # OK is final, as in the SDK
            return
        self._status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(self, exception: BaseException, attributes: Mapping[str, Any] | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        cls = type(exception)
        module = cls.__module__
        event = {
            "exception.type": f"{module}.{cls.__qualname__}" if module and module != "builtins" else cls.__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time if end_time is not None else time.time_ns()
        if self._rollout_id is None:
            count("spans_outside_rollout")
            return
        try:
            status = self._status
            self._write(SpanRow(self._rollout_id, self._seq, self._trace_id, self._span_id, self._parent_id, self.name,
                                KIND_NAMES[self.kind], self.start_time, self.end_time,
                                STATUS_NAMES[status.status_code], status.description, self.attributes,
                                self._events, self.tokens))
        except Exception as exc:  # never into the agent
            report_failure("span export", exc)

    def __repr__(self) -> str:
        return f"RecordSpan(name={self.name!r}, span_id={self._span_id:016x})"


class RecordTracer(otel_trace.Tracer):
    """Hands out :class:`RecordSpan` with the SDK tracer's ids and parenting (see the module's docstring)."""

    def __init__(self, write: Callable[[SpanRow], None]) -> None:
        self._write = write
        self._random = random.Random()  # its own generator: a user's random.seed() must not repeat our ids
        if hasattr(os, "register_at_fork"):  # a forked runner must not repeat its parent's ids (nor its siblings')
            os.register_at_fork(after_in_child=self._random.seed)

    def _ids(self, bits: int) -> int:
        value = self._random.getrandbits(bits)
        while not value:
            value = self._random.getrandbits(bits)
        return value

    def start_span(self, name: str, context: otel_context.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None, links: Any = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> RecordSpan:
        current = otel_trace.get_current_span(context)
        if type(current) is RecordSpan:  # ours: no SpanContext to make
            trace_id, parent_id, trace_state = current._trace_id, current._span_id, current._trace_state
        else:
            parent = current.get_span_context()
            if parent.is_valid:
                trace_id, parent_id, trace_state = parent.trace_id, parent.span_id, parent.trace_state
            else:
                trace_id, parent_id, trace_state = self._ids(128), None, None
        own: dict[str, Any] = {}
        if attributes and _SCALAR_TYPES.issuperset(map(type, attributes.values())):  # the usual case: one check
            own.update(attributes)
        elif attributes:
            for key, value in attributes.items():
                if type(value) in _SCALARS:
                    own[key] = value
                elif _valid(value):
                    own[key] = tuple(value) if type(value) is list else value
                elif value is not None:
                    _attribute_dropped(key, value)
        return RecordSpan(name, trace_id, self._ids(64), trace_state, parent_id, kind, start_time or time.time_ns(), own,
                          self._write)

    @contextlib.contextmanager
    def start_as_current_span(self, name: str, context: otel_context.Context | None = None,
                              kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
                              links: Any = None, start_time: int | None = None, record_exception: bool = True,
                              set_status_on_exception: bool = True, end_on_exit: bool = True) -> Iterator[RecordSpan]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with otel_trace.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                                 set_status_on_exception=set_status_on_exception) as current:
            yield current
