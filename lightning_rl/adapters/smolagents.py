"""smolagents: its agents' names on their LLM calls, and its tool calls as tool spans.

smolagents has no callback that runs before a model call or around a tool (its ``step_callbacks`` run
after a step, and its OpenTelemetry support is a separate package that wraps its methods). So, as that
instrumentation does, this adapter wraps two public methods, once, when smolagents is imported:

* ``MultiStepAgent.run``: a named agent (``name=``, which managed agents must have) runs inside
  ``agent_scope(name)``, so each LLM call it makes, and a managed agent's inside it, carries its name.
  An unnamed agent's calls carry the traced function's agent, as before. ``run(stream=True)`` is named
  while its steps are taken.
* ``Tool.__call__``: each tool call (``final_answer`` included) is an ``execute_tool {name}`` span with
  its arguments and result; its call id is the model's matching tool call (smolagents does not pass it
  to the tool), so call and result link up.

The LLM calls themselves are captured where they go: the openai client (``OpenAIServerModel``) or the
HTTP layer (``LiteLLMModel``). Outside a rollout both wrappers only call through.
"""

from __future__ import annotations

from typing import Any

from .wrapping import name_agent, record_tool


def _arguments(tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tool's arguments as the model sent them (a dict of its inputs), where they can be told."""
    kwargs = {k: v for k, v in kwargs.items() if k != "sanitize_inputs_outputs"}
    if not args:
        return kwargs
    if len(args) == 1 and not kwargs and isinstance(args[0], dict):
        return args[0]
    names = list(getattr(tool, "inputs", None) or {})
    return {**dict(zip(names, args)), **kwargs} if len(names) >= len(args) else {"args": list(args), **kwargs}


def instrument() -> bool:
    """Wrap ``MultiStepAgent.run`` and ``Tool.__call__`` (once per process)."""
    try:
        from smolagents.agents import MultiStepAgent
        from smolagents.tools import Tool
    except ImportError:
        return False
    name_agent(MultiStepAgent, "run", lambda agent: getattr(agent, "name", None))
    record_tool(Tool, "__call__", lambda tool: getattr(tool, "name", None) or type(tool).__name__, _arguments)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
