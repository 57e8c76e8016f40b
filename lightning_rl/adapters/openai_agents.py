"""The OpenAI Agents SDK (``openai-agents``): its agents' names on their LLM calls, and its tools and
handoffs as tool spans, through the SDK's own tracing processors (``add_trace_processor``).

The LLM calls themselves are captured where every model call goes: the openai client (chat completions,
``OpenAIChatCompletionsModel``) or the HTTP layer (the Responses API, the SDK's default, sent to the
engine as chat completions: ``http_clients.py``). This adapter only reads the SDK's spans:

* an ``agent`` span names the agent running inside it: an LLM call made while it is the nearest agent
  span above the SDK's current span carries that name (``register_agent_resolver``);
* a ``function`` span (a function tool) becomes an ``execute_tool {name}`` span with its arguments and
  result when it ends; its call id is the model's matching tool call (the SDK's span does not carry it);
* a ``handoff`` span becomes an ``execute_tool transfer_to_{agent}`` span (the SDK answers a handoff as a
  tool call of that name).

The SDK's other processors (its default export to OpenAI) are untouched. With the SDK's tracing switched
off (``RunConfig(tracing_disabled=True)``, ``OPENAI_AGENTS_DISABLE_TRACING``) its calls are still captured,
without the agents' names or tool spans.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from ..diagnostics import report_failure
from ..tracer.context import current_rollout, register_agent_resolver
from ..tracer.provider import record_finished_tool_span

_lock = threading.Lock()
# span_id -> (parent span_id, agent name or None): what the resolver walks up from the current span
_spans: dict[str, tuple[str | None, str | None]] = {}
_MAX_SPANS = 100_000


def _ns(iso: str | None) -> int | None:
    if not iso:
        return None
    try:
        return int(dt.datetime.fromisoformat(iso).timestamp() * 1e9)
    except ValueError:
        return None


def _agent_of(span_id: str | None) -> str | None:
    with _lock:
        for _ in range(64):  # the SDK's spans nest a few levels; a cycle cannot make this loop for ever
            entry = _spans.get(span_id) if span_id else None
            if entry is None:
                return None
            parent, name = entry
            if name:
                return name
            span_id = parent
    return None


def _handoff_tool(agent: str | None) -> str:
    """The tool name the SDK gives the model for a handoff to ``agent`` (``transfer_to_<agent>``)."""
    try:
        from agents.util._transforms import transform_string_function_style
    except ImportError:  # pragma: no cover (the SDK moved it: the plain form)
        return f"transfer_to_{str(agent).lower().replace(' ', '_')}"
    return f"transfer_to_{transform_string_function_style(str(agent))}"


def current_agent() -> str | None:
    """The agent whose run the SDK's current span is in (None outside the SDK's runs)."""
    from agents.tracing import get_current_span

    span = get_current_span()
    return _agent_of(span.span_id) if span is not None else None


def _processor_class() -> type:
    from agents.tracing import TracingProcessor

    class RolloutProcessor(TracingProcessor):
        """Keeps the SDK's span tree (for agent names) and turns its tool spans into ours. Never raises."""

        def on_trace_start(self, trace: Any) -> None:
            pass

        def on_trace_end(self, trace: Any) -> None:
            pass

        def on_span_start(self, span: Any) -> None:
            try:
                data = span.span_data
                name = data.name if getattr(data, "type", None) == "agent" else None
                with _lock:
                    if len(_spans) >= _MAX_SPANS:
                        _spans.clear()
                    _spans[span.span_id] = (span.parent_id, name)
            except Exception as exc:
                report_failure("openai-agents span", exc)

        def on_span_end(self, span: Any) -> None:
            try:
                data = span.span_data
                kind = getattr(data, "type", None)
                if current_rollout() is not None and kind in ("function", "handoff"):
                    agent = _agent_of(span.parent_id)
                    error = span.error.get("message") if isinstance(span.error, dict) else None
                    times = dict(start_ns=_ns(span.started_at), end_ns=_ns(span.ended_at), error=error)
                    if kind == "function":
                        record_finished_tool_span(data.name, arguments=data.input, result=data.output, agent=agent,
                                                  **times)
                    else:
                        record_finished_tool_span(_handoff_tool(data.to_agent), agent=data.from_agent or agent,
                                                  result={"assistant": data.to_agent}, **times)
            except Exception as exc:
                report_failure("openai-agents span", exc)
            finally:
                with _lock:
                    _spans.pop(span.span_id, None)

        def shutdown(self) -> None:
            pass

        def force_flush(self) -> None:
            pass

    return RolloutProcessor


_installed = False


def instrument() -> bool:
    """Add the processor to the SDK's tracing (once) and name agents from its spans."""
    global _installed
    try:
        from agents.tracing import add_trace_processor
    except ImportError:
        return False
    with _lock:
        if _installed:
            return True
        _installed = True
    add_trace_processor(_processor_class()())
    register_agent_resolver(current_agent)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
