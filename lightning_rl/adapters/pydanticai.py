"""PydanticAI: its agents' names on their LLM calls, and its tool calls as tool spans, whatever its own
instrumentation is (off, ``agent.instrument = False``, or the program's: ``Agent.instrument_all(...)``,
``logfire.instrument_pydantic_ai()``). Nothing here reads or sets PydanticAI's OpenTelemetry instrumentation, so
its spans go where the program sends them, and ours are recorded once.

* The agent: PydanticAI makes each model request with the run's ``RunContext`` current
  (``pydantic_ai._run_context.get_current_run_context()``, what its own model code reads); an LLM call made then
  carries ``ctx.agent.name`` (``Agent(name=...)``, else the name PydanticAI infers from the variable). Where that
  is not available (an older PydanticAI), the name its instrumentation puts in the OpenTelemetry baggage
  (``gen_ai.agent.name``), when the program instruments it.
* Each tool call: every function tool a run executes goes through ``ToolManager.execute_tool_call`` (wrapped once,
  on import): an ``execute_tool {tool}`` span with the model's call id, the arguments and the result, run by the
  run's agent. A call the model is told to retry (``ModelRetry``, arguments that fail validation) or that failed
  is an error span; a call deferred for approval records nothing until it runs. While a tool runs the rollout
  counts it as a framework's (``framework_tool_started``): an MCP tool PydanticAI runs (``pydantic_ai.mcp``) is
  this one span, not a second one from the MCP client session (``adapters/mcp.py``).

The LLM calls are captured where they go: the openai client (``OpenAIChatModel``) or the HTTP layer
(``OpenAIResponsesModel``). Outside a rollout the wrapper only calls through; tracing never raises into the run.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from opentelemetry import baggage

from ..diagnostics import report_failure
from ..tracer.context import current_rollout, register_agent_resolver
from ..tracer.provider import record_finished_tool_span

AGENT_BAGGAGE = "gen_ai.agent.name"
_MARK = "__lightning_rl__"
_current_run_context: Any = None  # pydantic_ai._run_context.get_current_run_context, where it exists


def _agent_name(run_context: Any) -> str | None:
    name = getattr(getattr(run_context, "agent", None), "name", None)
    return name if isinstance(name, str) and name else None


def current_agent() -> str | None:
    """The PydanticAI agent whose model request is being made (its run context), else the name its
    instrumentation put in the OpenTelemetry baggage."""
    if _current_run_context is not None:
        name = _agent_name(_current_run_context())
        if name:
            return name
    name = baggage.get_baggage(AGENT_BAGGAGE)
    return name if isinstance(name, str) and name else None


def _deferral() -> tuple[type, ...]:
    try:
        from pydantic_ai.exceptions import ApprovalRequired, CallDeferred
    except ImportError:  # pragma: no cover (an older PydanticAI)
        return ()
    return (CallDeferred, ApprovalRequired)


def _wrap_execute(original: Any) -> Any:
    deferred = _deferral()

    @functools.wraps(original)
    async def execute_tool_call(self: Any, validated: Any, *args: Any, **kwargs: Any) -> Any:
        state = current_rollout()
        if state is None:
            return await original(self, validated, *args, **kwargs)
        try:
            call = validated.call
            name, call_id, arguments = str(call.tool_name), call.tool_call_id or None, call.args
            agent = _agent_name(validated.ctx)
        except Exception as exc:  # the tool runs unrecorded
            report_failure("pydantic-ai tool span", exc)
            return await original(self, validated, *args, **kwargs)
        start_ns = time.time_ns()
        state.framework_tool_started()
        result = error = None
        try:
            result = await original(self, validated, *args, **kwargs)
            return result
        except deferred:
            name = None  # not run yet: recorded when it runs
            raise
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            raise
        finally:
            state.framework_tool_ended()
            if name is not None:
                record_finished_tool_span(name, call_id=call_id, arguments=arguments, result=result, agent=agent,
                                          start_ns=start_ns, end_ns=time.time_ns(), error=error)

    return execute_tool_call


_installed = False


def instrument() -> bool:
    """Name agents from their run context; record every tool call ``ToolManager`` executes (once per process)."""
    global _installed, _current_run_context
    try:
        from pydantic_ai.tool_manager import ToolManager
    except ImportError:
        return False
    if _installed:
        return True
    _installed = True
    try:
        from pydantic_ai._run_context import get_current_run_context

        _current_run_context = get_current_run_context
    except ImportError:
        report_failure("pydantic-ai agent name", message=(
            "lightning-rl: this PydanticAI has no pydantic_ai._run_context.get_current_run_context, so an LLM call "
            "carries its agent's name only where the program instruments PydanticAI (Agent.instrument_all()); "
            "lightning-rl is tested with pydantic-ai-slim 2.68.0. Counted (logged once)"))
    register_agent_resolver(current_agent)
    original = ToolManager.__dict__.get("execute_tool_call")
    if original is None:
        report_failure("pydantic-ai tool span", message=(
            "lightning-rl: this PydanticAI has no ToolManager.execute_tool_call, so its tool calls are not recorded "
            "as tool spans; record them with lrl.tool_span (lightning-rl is tested with pydantic-ai-slim 2.68.0). "
            "Counted (logged once)"))
    elif not getattr(original, _MARK, False):
        wrapped = _wrap_execute(original)
        setattr(wrapped, _MARK, True)
        ToolManager.execute_tool_call = wrapped
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
