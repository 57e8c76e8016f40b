"""The process's tracing state (``tracing``: the private OpenTelemetry provider and the processor that hands
finished spans to the sink, both in ``processor.py``), and our spans in the caller's context: the parent a span
starts under, agent and tool spans.

We never touch the global provider: a user's own OTel set-up keeps working, shares the context (so
parenting works across providers), and can also receive our spans (``configure(span_processors=...)``).

Capture is training data, not telemetry export: ``OTEL_SDK_DISABLED=true`` (which CrewAI's docs tell
users to set, and many production images do) switches off the user's own OpenTelemetry SDK, never our
private provider. User span processors honour it: they are not attached while it is set (logged once).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from .. import semconv
from ..diagnostics import count, report_failure
from ..errors import ConfigurationError
from ..records import PackedTokens, SpanRow
from ..settings import Settings, load_redactor
from .canary import Canary
from .context import _our_span, _rollout
from .processor import CaptureProvider, RolloutSpanProcessor, otel_sdk_disabled
from .records import RecordSpan, RecordTracer
from .redaction import FAILED, redact_row
from .versions import PolicyVersions
from ..sink import SpanSink

INSTRUMENTATION_NAME = "lightning_rl"
#: ``CaptureProvider``, ``RolloutSpanProcessor`` and ``otel_sdk_disabled`` (``processor.py``) are imported from
#: here too.


class Tracing:
    """Process-wide tracing state: private provider, tracer, sink, settings; the policy versions and canaries
    (``versions.py``) behind the same methods as before."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.settings = Settings.from_env()
        self._sink: SpanSink | None = None
        self._sink_factory: Callable[[str], SpanSink] | None = None
        #: this process's policy versions and the store's publishes and canaries (versions.py)
        self.versions = PolicyVersions(self.settings, self.current_sink)
        limits = SpanLimits(
            max_span_attributes=512,
            max_events=1024,
            max_event_attributes=128,
            max_attribute_length=SpanLimits.UNSET,  # never truncate messages or token arrays
            max_span_attribute_length=SpanLimits.UNSET,
        )
        self._limits = limits
        self._unloadable_spec: str | None = None
        self.processor = RolloutSpanProcessor(self.sink, self.redaction, self.keep_redacted_tokens)
        self._records = RecordTracer(self._write_span)
        self.remove_span_processors()

    def _write_span(self, row: SpanRow) -> None:
        redact = self.redaction()
        if redact is not None:
            row = redact_row(row, redact, self.settings.redacted_tokens == "keep")
        self.sink().write_span(row)

    # -- redaction (tracer/redaction.py) ----------------------------------------------------------
    def redaction(self, *, check: bool = False) -> Callable[[str], str] | None:
        """The redaction function, or None. LIGHTNING_RL_REDACT's ``module:function`` is imported on first
        use: ``check=True`` (configure, a rollout's start, the gateway's) raises its ConfigurationError;
        elsewhere (a span ending) a function that cannot be loaded fails closed: every text is replaced."""
        fn = self.settings.redact
        spec = self.settings.redact_spec
        if isinstance(fn, RefusedRedaction) and check:
            raise fn.error
        if fn is not None or spec is None:
            return fn
        if not check and spec == self._unloadable_spec:  # tried: no import per span
            return _unloadable
        try:
            fn = self.settings.redact = load_redactor(spec)
        except ConfigurationError as exc:
            if check:
                raise
            self._unloadable_spec = spec
            report_failure("loading the redaction function", message=f"lightning-rl: {exc}; until it loads, every "
                           f"text is recorded as {FAILED!r} (logged once)")
            return _unloadable
        return fn

    def keep_redacted_tokens(self) -> bool:
        return self.settings.redacted_tokens == "keep"

    def remove_span_processors(self) -> None:
        """Forget the user's span processors (tests; a process that configures tracing anew): spans are
        recorded straight to the sink again, with no SDK span (see ``records.py``)."""
        with self._lock:
            # ALWAYS_ON: an OTEL_TRACES_SAMPLER meant for the user's own tracing must not sample away training data.
            self.provider = CaptureProvider(
                sampler=ALWAYS_ON,
                span_limits=self._limits,
                resource=Resource.create({"service.name": "lightning-rl"}),
            )
            self.provider.add_span_processor(self.processor)
            self.listeners = 0
            #: What our spans are made with: RecordTracer while nobody but the store listens, else the SDK's.
            self.tracer: Any = self._records

    def attach_tokens(self, span: Any, tokens: PackedTokens) -> None:
        """Send ``tokens`` with ``span`` (one of ours) when it ends, beside its attributes."""
        if type(span) is RecordSpan:
            span.tokens = tokens
        else:
            self.processor.attach_tokens(span, tokens)

    # -- sink -----------------------------------------------------------------------------------
    def set_sink_factory(self, factory: Callable[[str], SpanSink]) -> None:
        self._sink_factory = factory

    def set_sink(self, sink: SpanSink | None) -> None:
        with self._lock:
            old, self._sink = self._sink, sink
            if old is not sink:  # publishes read from the previous store are not this one's
                self.versions.forget_store()
        if old is not None and old is not sink:
            try:
                old.flush()
            except Exception as exc:
                report_failure("flush of the previous store", exc)

    def current_sink(self) -> SpanSink | None:
        """The sink in use, without opening the default one."""
        return self._sink

    def sink(self) -> SpanSink:
        sink = self._sink
        if sink is not None:
            return sink
        with self._lock:
            if self._sink is None:
                if self._sink_factory is None:
                    raise ConfigurationError("no store is configured; call lightning_rl.configure(store=...)")
                self._sink = self._sink_factory(self.settings.store)
            return self._sink

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Also give our spans to a processor of the user's (e.g. their exporter), unless the user switched
        their OpenTelemetry SDK off (``OTEL_SDK_DISABLED``): that variable is theirs, capture is ours."""
        if otel_sdk_disabled():
            count("span_processors_not_attached_otel_sdk_disabled")
            report_failure("span processors with OTEL_SDK_DISABLED", message=(
                "lightning-rl: OTEL_SDK_DISABLED=true, so the span processors given to configure(span_processors=...) "
                "are not attached (your OpenTelemetry export is off). Rollouts, LLM calls and token ids are still "
                "recorded: capture is training data, not telemetry (logged once)"))
            return
        with self._lock:
            self.provider.add_span_processor(processor)
            self.listeners += 1
            self.tracer = self.provider.get_tracer(INSTRUMENTATION_NAME)  # someone listens: SDK spans from now on

    # -- policy versions and canaries (versions.py) ---------------------------------------------
    def set_policy_version(self, version: int, model: str | None = None, *, served_as: str | None = None) -> None:
        """``model`` answers with ``version`` from now on in this process; ``served_as``: the versioned name
        every replica serves it under (traced calls are sent there, ``served_as``)."""
        self.versions.set(version, model, served_as=served_as)

    def reset_policy_versions(self, default: int = 0) -> None:
        """Forget every version this process set or read (tests; a new run in the same process)."""
        self.versions.reset(default)

    def policy_version(self, model: str | None = None) -> int:
        """The version ``model`` (a served name) answers with, as this process knows it now."""
        return self.versions.version(model)

    def served_as(self, model: Any) -> tuple[str, int] | None:
        """Where a traced call for ``model`` goes instead, and the version it is stamped with, or None."""
        return self.versions.served_as(model)

    def canary(self, mode: Any, rollout_id: str, model: Any) -> Canary | None:
        """The candidate a production rollout's call to ``model`` goes to instead (``canary.py``), or None."""
        return self.versions.canary(mode, rollout_id, model)


def _unloadable(text: str) -> str:
    raise ConfigurationError("the redaction function named by LIGHTNING_RL_REDACT cannot be loaded")


class RefusedRedaction:
    """What a redaction that ``configure`` could not set up leaves in its place (fail closed): a rollout's
    start raises the ``error`` (``redaction(check=True)``), and a text that still reaches a span (one
    begun before) is recorded as redaction failed, until ``configure`` is given a redaction that works."""

    __slots__ = ("error",)

    def __init__(self, error: ConfigurationError) -> None:
        self.error = error

    def __call__(self, text: str) -> str:
        raise self.error


tracing = Tracing()


def parent_context(parent: Any = None) -> Any:
    """The OTel context to start one of our spans in: ``parent`` if given; else the current context,
    unless its span is invalid (a framework's no-op span when no global provider is set), in which
    case our innermost span, so that no span of a rollout ever starts a new trace."""
    if parent is not None:
        return otel_trace.set_span_in_context(parent)
    if otel_trace.get_current_span().get_span_context().is_valid:
        return None
    ours = _our_span.get()
    return otel_trace.set_span_in_context(ours) if ours is not None else None


def current_our_span() -> Any:
    """Our innermost span in this context (a rollout's, an agent's), or None."""
    return _our_span.get()


@contextlib.contextmanager
def current_span_of_ours(span: Any) -> Iterator[None]:
    """Make ``span`` (one of ours) the current OTel span and our innermost span for the block."""
    token = _our_span.set(span)
    try:
        with otel_trace.use_span(span, end_on_exit=False):
            yield
    finally:
        _our_span.reset(token)


@contextlib.contextmanager
def agent_span(name: str) -> Iterator[None]:
    """An ``invoke_agent {name}`` span made current for the block, when a rollout is active."""
    if _rollout.get() is None:
        yield
        return
    try:
        span = tracing.tracer.start_span(
            f"invoke_agent {name}",
            context=parent_context(),
            attributes={
                semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                semconv.GEN_AI_AGENT_NAME: name,
            },
        )
    except Exception as exc:
        report_failure("agent span", exc)
        yield
        return
    token = _our_span.set(span)
    try:
        with otel_trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            yield
    finally:
        _our_span.reset(token)


@contextlib.contextmanager
def record_tool_span(name: str, call_id: str | None, arguments: Any, handle: Any) -> Iterator[None]:
    if _rollout.get() is None:
        yield
        return
    from .context import current_agent_name

    span = None
    try:
        span = tracing.tracer.start_span(f"execute_tool {name}", context=parent_context(),
                                         attributes=_tool_attributes(name, call_id, arguments, current_agent_name()))
    except Exception as exc:
        report_failure("tool span", exc)
    if span is None:
        yield
        return
    try:
        with otel_trace.use_span(span, end_on_exit=False, record_exception=True, set_status_on_exception=True):
            yield
    finally:
        try:
            if handle.result is not None:
                result = handle.result
                span.set_attribute(semconv.TOOL_RESULT, result if isinstance(result, str) else _json(result))
        except Exception as exc:
            report_failure("tool span result", exc)
        span.end()


def _tool_attributes(name: str, call_id: str | None, arguments: Any, agent: str | None) -> dict[str, Any]:
    """A tool span's attributes. Without a call id, the id of the model's matching tool call (from this
    rollout's LLM answers), so a framework whose tool hook does not carry it still links call and result,
    and the agent whose LLM call asked for it (a framework may run its tools outside the agent's step)."""
    state = _rollout.get()
    if not call_id and state is not None:
        claimed = state.claim_tool_call(name, arguments)
        if claimed is not None:  # the tool runs for the agent whose model asked for it
            call_id, agent = claimed[0], claimed[1] or agent
    attrs: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.GEN_AI_TOOL_NAME: name}
    if call_id:
        attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    if arguments is not None:
        attrs[semconv.TOOL_ARGUMENTS] = arguments if isinstance(arguments, str) else _json(arguments)
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return attrs


def record_finished_tool_span(name: str, *, call_id: str | None = None, arguments: Any = None, result: Any = None,
                              agent: str | None = None, start_ns: int | None = None, end_ns: int | None = None,
                              error: str | None = None, attributes: dict[str, Any] | None = None) -> None:
    """A tool call a framework reports after it ran (its hook gives times, arguments and result): an
    ``execute_tool {name}`` span of the active rollout, with the framework's own ``attributes`` added.
    Never raises."""
    if _rollout.get() is None:
        return
    try:
        from .context import current_agent_name

        attrs = _tool_attributes(name, call_id, arguments, agent or current_agent_name())
        if result is not None:
            attrs[semconv.TOOL_RESULT] = result if isinstance(result, str) else _json(result)
        attrs.update(attributes or {})
        span = tracing.tracer.start_span(f"execute_tool {name}", context=parent_context(), attributes=attrs,
                                         start_time=start_ns)
        if error:
            span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, error))
        span.end(end_time=end_ns)
    except Exception as exc:
        report_failure("tool span", exc)


def _json(value: Any) -> str:
    import orjson

    return orjson.dumps(value, default=repr).decode()


def add_span_processors(processors: Sequence[SpanProcessor]) -> None:
    for processor in processors:
        tracing.add_span_processor(processor)
