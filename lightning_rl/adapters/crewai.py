"""CrewAI: each agent's role on its LLM calls, and its tool calls as tool spans.

CrewAI has no hook that runs in the caller's context before a model call or around a tool (its event
handlers run later, on a thread pool: a tool span recorded there could land after the rollout was read).
So, as OpenTelemetry's CrewAI instrumentation does, this adapter wraps public methods once, on import
(``wrapping.py``):

* ``Agent.execute_task``/``aexecute_task`` (an agent's turn in a crew) and ``Agent.kickoff``/
  ``kickoff_async`` (an agent on its own) run inside ``agent_scope(role)``;
* a tool's ``run``/``arun`` (native function calling) and ``CrewStructuredTool.invoke``/``ainvoke`` (the
  ReAct text path) are an ``execute_tool {tool}`` span with the arguments and the result; its call id,
  where the model made one, is the model's matching tool call. A structured tool calling its tool's own
  ``run`` is one span.

The LLM calls are captured where they go: CrewAI's native OpenAI provider (``LLM("openai/...",
base_url=...)``) uses the openai client; its LiteLLM route, the HTTP layer. CrewAI's docs set
``OTEL_SDK_DISABLED=true`` to stop its telemetry: that never switches lightning-rl's capture off.
"""

from __future__ import annotations

from typing import Any

from .wrapping import name_agent, record_tool


def _run_arguments(tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs if not args else {"args": list(args), **kwargs}


def _invoke_arguments(tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("input")


def _tool_name(tool: Any) -> str:
    return str(getattr(tool, "name", None) or type(tool).__name__)


def instrument() -> bool:
    """Name each agent's calls by its role; record its tool calls (once per process)."""
    try:
        from crewai.agent.core import Agent
        from crewai.tools.base_tool import BaseTool, Tool
        from crewai.tools.structured_tool import CrewStructuredTool
    except ImportError:
        return False
    for method in ("execute_task", "aexecute_task", "kickoff", "kickoff_async"):
        name_agent(Agent, method, lambda agent: getattr(agent, "role", None))
    for tool_class in (BaseTool, Tool):
        record_tool(tool_class, "run", _tool_name, _run_arguments)
        record_tool(tool_class, "arun", _tool_name, _run_arguments)
    record_tool(CrewStructuredTool, "invoke", _tool_name, _invoke_arguments)
    record_tool(CrewStructuredTool, "ainvoke", _tool_name, _invoke_arguments)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
