"""LlamaIndex agents (``FunctionAgent``, ``ReActAgent``, ``CodeActAgent``, in an ``AgentWorkflow`` or on their
own): each agent's name on its LLM calls, and each tool call as a tool span.

LlamaIndex's instrumentation dispatcher does not cover a workflow agent's step or its tool calls, so, as
OpenTelemetry's LlamaIndex instrumentation does, this adapter wraps public methods once, on import:

* ``take_step`` of each agent class (the step that calls the model) runs inside ``agent_scope(agent.name)``
  (``FunctionAgent(name=...)``; LlamaIndex's default name is ``Agent``);
* ``FunctionTool.call``/``acall`` (every tool an agent calls, ``handoff`` included): an ``execute_tool {name}``
  span with its arguments and result (the ``ToolOutput``'s content); its call id is the model's matching
  tool call.

The LLM calls are captured where they go: LlamaIndex's OpenAI LLMs (``OpenAI``, ``OpenAILike``) use the
openai client.
"""

from __future__ import annotations

from typing import Any

from .wrapping import name_agent, record_tool


def _arguments(tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs if not args else {"args": list(args), **kwargs}


def _content(output: Any) -> Any:
    content = getattr(output, "content", output)
    return content if content is None or isinstance(content, (str, int, float, bool, list, dict)) else str(content)


def _tool_name(tool: Any) -> str:
    metadata = getattr(tool, "metadata", None)
    return str(getattr(metadata, "name", None) or type(tool).__name__)


def instrument() -> bool:
    try:
        from llama_index.core.agent.workflow import CodeActAgent, FunctionAgent, ReActAgent
        from llama_index.core.tools import FunctionTool
    except ImportError:
        return False
    for agent_class in (FunctionAgent, ReActAgent, CodeActAgent):
        name_agent(agent_class, "take_step", lambda agent: getattr(agent, "name", None))
    record_tool(FunctionTool, "call", _tool_name, _arguments, _content)
    record_tool(FunctionTool, "acall", _tool_name, _arguments, _content)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
