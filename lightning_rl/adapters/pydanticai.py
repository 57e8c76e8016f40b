"""PydanticAI: its agents' names on their LLM calls, and its tool calls as tool spans, from PydanticAI's
own OpenTelemetry instrumentation.

The LLM calls are captured where they go: the openai client (``OpenAIChatModel``) or the HTTP layer
(``OpenAIResponsesModel``). PydanticAI, when instrumented, runs each agent inside an ``invoke_agent``
span and puts the agent's name in the OpenTelemetry baggage (``gen_ai.agent.name``): an LLM call made
inside carries that name. Each tool it runs is an ``execute_tool {tool}`` span with the call id,
arguments and result: it becomes our tool span when it ends.

If the program has not instrumented PydanticAI itself, ``instrument()`` does it for every agent
(``Agent.instrument_all``) with a private tracer provider that exports nothing anywhere: only its tool
spans are read, into the active rollout. A program that instruments PydanticAI itself (logfire, its own
provider) keeps its settings; its agents' names are still read from the baggage, and its tool spans go
where it sends them (not into the rollout): record them with ``lrl.tool_span`` if needed.
"""

from __future__ import annotations

from opentelemetry import baggage
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from .. import semconv
from ..diagnostics import report_failure
from ..tracer.context import current_rollout, register_agent_resolver
from ..tracer.provider import CaptureProvider, record_finished_tool_span

AGENT_BAGGAGE = "gen_ai.agent.name"


def current_agent() -> str | None:
    """The PydanticAI agent whose run this is (from the OpenTelemetry baggage its instrumentation sets)."""
    name = baggage.get_baggage(AGENT_BAGGAGE)
    return name if isinstance(name, str) and name else None


class ToolSpans(SpanProcessor):
    """PydanticAI's ``execute_tool`` spans, as they end, into the active rollout's tool spans."""

    def on_end(self, span: ReadableSpan) -> None:
        try:
            attrs = span.attributes or {}
            if attrs.get(semconv.GEN_AI_OPERATION_NAME) != semconv.OP_EXECUTE_TOOL or current_rollout() is None:
                return
            name = attrs.get(semconv.GEN_AI_TOOL_NAME)
            if not isinstance(name, str):
                return
            error = span.status.description if not span.status.is_ok else None
            record_finished_tool_span(
                name, call_id=attrs.get(semconv.GEN_AI_TOOL_CALL_ID) or None,
                arguments=attrs.get(semconv.TOOL_ARGUMENTS, attrs.get("tool_arguments")),
                result=attrs.get(semconv.TOOL_RESULT, attrs.get("tool_response")),
                agent=attrs.get(semconv.GEN_AI_AGENT_NAME) or current_agent(),
                start_ns=span.start_time, end_ns=span.end_time, error=error)
        except Exception as exc:
            report_failure("pydantic-ai tool span", exc)


_installed = False


def instrument() -> bool:
    """Name agents from the baggage; instrument every agent with a private provider if the program has not."""
    global _installed
    try:
        from pydantic_ai import Agent
        from pydantic_ai.models.instrumented import InstrumentationSettings
    except ImportError:
        return False
    if _installed:
        return True
    _installed = True
    register_agent_resolver(current_agent)
    if getattr(Agent, "_instrument_default", False) is False:  # the program's own choice wins
        provider = CaptureProvider()
        provider.add_span_processor(ToolSpans())
        Agent.instrument_all(InstrumentationSettings(tracer_provider=provider, include_content=True))
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
