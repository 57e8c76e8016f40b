"""Google ADK (google-adk 2.x): its agents' names on their LLM calls, and its tool runs as tool spans.

ADK has its own OpenTelemetry spans (on the global provider, when one is set) and a plugin system (a
``BasePlugin`` a ``Runner`` or ``App`` is given). Neither is used here: a plugin must be handed to every
``Runner`` (an ``AgentTool`` makes its own), runs in order and stops at the first that answers a
callback, and opens and closes a tool's span in two callbacks. Instead, as the other adapters do
(``wrapping.py``), public methods are wrapped once, when ``google.adk`` is imported:

* ``BaseAgent.run_async`` (and ``run_live``), which every agent runs through: an ``LlmAgent``, a
  sub-agent it transfers to (``transfer_to_agent``), the agent an ``AgentTool`` runs, a workflow agent.
  A named agent runs inside ``agent_scope(agent.name)``, so each LLM call it makes carries its name,
  and a sub-agent's calls its own.
* ``run_async`` of ``BaseTool`` and of every subclass that defines its own (ADK's ``FunctionTool``,
  ``AgentTool``, ``McpTool``, ..., and the user's, wrapped when the class is made): each run is an
  ``execute_tool {tool.name}`` span, current while the tool runs, with its arguments (as the model sent
  them), its result, the error it raised (the span's status), and the model's call id
  (``ToolContext.function_call_id``). A subclass calling ``super().run_async`` is one span. While it
  runs the rollout counts it as a framework tool (``framework_tool_started``), so an MCP client session
  under it records no second span. A call answered by a ``before_tool_callback`` ran no tool: no span.

The LLM calls are captured where they go: ``LiteLlm("openai/<served name>", api_base=...)`` sends them
through the openai client (the OpenAI adapter: engine token ids and log-probs, streamed or not); other
LiteLLM routes are seen at the HTTP layer. Outside a rollout every wrapper only calls through.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

from ..diagnostics import report_failure
from ..tracer.context import agent_scope, current_rollout, tool_span

_MARK = "__lightning_rl__"
# the tool object whose span is open: a subclass's run_async calling its base's is one span
_open_tool: ContextVar[Any] = ContextVar("lightning_rl_adk_open_tool", default=None)


def _mark(wrapper: Any, original: Any) -> Any:
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, True)
    return wrapper


def _agent_name(agent: Any) -> str | None:
    if current_rollout() is None:
        return None
    name = getattr(agent, "name", None)
    return name if isinstance(name, str) and name else None


def _close(scope: Any, exc: BaseException | None) -> None:
    """Leave an agent scope; a generator closed from another context cannot reset its name: said once."""
    try:
        scope.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
    except ValueError as error:
        report_failure("google adk agent scope", error)


def _named_agent(original: Callable[..., AsyncIterator[Any]]) -> Any:
    """``run_async``/``run_live`` (async generators) run inside ``agent_scope`` of the agent's name."""

    async def run(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        name = _agent_name(self)
        if name is None:
            async with contextlib.aclosing(original(self, *args, **kwargs)) as events:
                async for event in events:
                    yield event
            return
        scope = agent_scope(name)
        scope.__enter__()
        try:
            async with contextlib.aclosing(original(self, *args, **kwargs)) as events:
                async for event in events:
                    yield event
        except BaseException as exc:
            _close(scope, exc)
            raise
        _close(scope, None)

    return _mark(run, original)


def _storable(result: Any) -> Any:
    return result if result is None or isinstance(result, (str, int, float, bool, list, dict)) else str(result)


def _opened(tool: Any, args: Any, tool_context: Any) -> tuple[Any, Any, Any, Any] | None:
    """Open the tool's span (None: outside a rollout, an inner layer of an open one, or unreadable)."""
    state = current_rollout()
    if state is None or _open_tool.get() is tool:
        return None
    try:
        call_id = getattr(tool_context, "function_call_id", None)
        span = tool_span(str(getattr(tool, "name", None) or type(tool).__name__),
                         call_id=call_id if isinstance(call_id, str) and call_id else None,
                         arguments=args if isinstance(args, dict) else _storable(args))
        handle = span.__enter__()
    except Exception as exc:  # the tool runs unrecorded
        report_failure(f"tool span of {type(tool).__name__}", exc)
        return None
    state.framework_tool_started()
    return state, span, handle, _open_tool.set(tool)


def _ended(entered: tuple[Any, Any, Any, Any], result: Any, exc: BaseException | None) -> None:
    state, span, handle, token = entered
    _open_tool.reset(token)
    state.framework_tool_ended()
    if exc is not None:
        span.__exit__(type(exc), exc, exc.__traceback__)  # on the span; the caller raises it as it was
        return
    try:
        handle.result = _storable(result)
    except Exception as error:
        report_failure("tool result", error)
    span.__exit__(None, None, None)


def _recorded_tool(original: Callable[..., Any]) -> Any:
    """A tool class's own ``run_async(*, args, tool_context)``, recorded as a tool span."""

    async def run_async(self: Any, *pos: Any, **kwargs: Any) -> Any:
        entered = _opened(self, kwargs.get("args"), kwargs.get("tool_context")) if not pos else None
        if entered is None:
            return await original(self, *pos, **kwargs)
        try:
            result = await original(self, *pos, **kwargs)
        except BaseException as exc:
            _ended(entered, None, exc)
            raise
        _ended(entered, result, None)
        return result

    return _mark(run_async, original)


def _wrap_tool_class(cls: type) -> None:
    original = cls.__dict__.get("run_async")
    if inspect.iscoroutinefunction(original) and not getattr(original, _MARK, False):
        cls.run_async = _recorded_tool(original)


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(current.__subclasses__())
    return found


def _hook_subclasses(base: type) -> None:
    """Wrap the ``run_async`` of every tool class made from now on, as it is made."""
    if getattr(base.__dict__.get("__init_subclass__"), _MARK, False):
        return
    own = base.__dict__.get("__init_subclass__")  # the base's own, if it has one; else its parents'

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if own is not None:
            own.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        try:
            _wrap_tool_class(cls)
        except Exception as exc:  # the class's tools run unrecorded
            report_failure(f"tool class {cls.__name__}", exc)

    setattr(__init_subclass__, _MARK, True)
    base.__init_subclass__ = classmethod(__init_subclass__)


def instrument() -> bool:
    """Name ADK's agents on their calls; record its tools' runs (once per process)."""
    from google.adk.agents.base_agent import BaseAgent
    from google.adk.tools.base_tool import BaseTool

    for attr in ("run_async", "run_live"):
        original = BaseAgent.__dict__.get(attr)
        if original is not None and not getattr(original, _MARK, False):
            setattr(BaseAgent, attr, _named_agent(original))
    for cls in _subclasses(BaseTool):
        _wrap_tool_class(cls)
    _hook_subclasses(BaseTool)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
