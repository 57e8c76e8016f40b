"""The OpenAI Agents SDK (``openai-agents``): its agents' names on their LLM calls, and its tools and handoffs as
tool spans, through the SDK's run hooks (``RunHooks``), not its tracing.

Teams that serve their own models switch the SDK's tracing off (``agents.set_tracing_disabled(True)``,
``OPENAI_AGENTS_DISABLE_TRACING=1``, ``RunConfig(tracing_disabled=True)``: its default export sends traces to
OpenAI), so nothing here reads it. Every run goes through ``AgentRunner.run`` or ``AgentRunner.run_streamed``
(``Runner.run``, ``run_sync`` and ``run_streamed`` call them); inside a rollout this adapter puts its own
``RunHooks`` in front of the program's (``hooks=``, which still get every call, in the same order) and:

* names the agent: ``on_llm_start`` comes just before each model call, with the agent making it; an LLM call made
  in that run carries its name until the next (a run's own record, shared by the hook tasks the SDK gathers and the
  model call, ``_Run``; a nested run, ``Agent.as_tool``, has its own);
* records each tool (``on_tool_start``/``on_tool_end``): an ``execute_tool {name}`` span with the model's call id
  (``ToolContext.tool_call_id``), its arguments and result (what the model is told), run by the agent that asked.
  A tool that fails is an error span: the SDK tells the model its failure message (its ``failure_error_function``),
  seen where the SDK asks for it; a failure that ends the run closes the span with the run's error. While a tool
  runs the rollout counts it as a framework's (``framework_tool_started``): an MCP tool the SDK runs
  (``agents.mcp``) is this one span, not a second one from the MCP client session (``adapters/mcp.py``);
* records each handoff (``on_handoff``) as ``execute_tool transfer_to_{agent}``, the tool call the SDK answers it
  as (its name from the handoff, ``tool_name_override`` included), run by the agent that handed off.

The SDK's tracing, on or off, is untouched: its own processors (its export, the program's) get their spans as
before, and nothing of ours is recorded twice. The LLM calls themselves are captured where every model call
goes: the openai client (chat completions, ``OpenAIChatCompletionsModel``) or the HTTP layer (the Responses API,
the SDK's default, sent to the engine as chat completions: ``http_clients.py``). Outside a rollout the runner is
called through untouched; tracing never raises into the run.
"""

from __future__ import annotations

import functools
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ..diagnostics import report_failure
from ..tracer.context import RolloutState, current_rollout, register_agent_resolver
from ..tracer.provider import record_finished_tool_span

_MARK = "__lightning_rl__"


@dataclass(slots=True)
class _Tool:
    """A tool the SDK started and has not ended yet."""

    name: str
    call_id: str | None
    arguments: Any
    agent: str | None
    state: RolloutState
    start_ns: int
    error: str | None = None


@dataclass(slots=True, eq=False)
class _Run:
    """One SDK run inside a rollout: the agent whose model call is next, and its tools running now. Shared (one
    object) by the run's task and the hook tasks it gathers, which see it through the copied context."""

    agent: str | None = None
    tools: dict[Any, _Tool] = field(default_factory=dict)


_run: ContextVar[_Run | None] = ContextVar("lightning_rl_openai_agents_run", default=None)


def current_agent() -> str | None:
    """The agent of the SDK run in this context whose model call is next (None outside the SDK's runs)."""
    run = _run.get()
    return run.agent if run is not None else None


def _name(agent: Any) -> str | None:
    name = getattr(agent, "name", None)
    return name if isinstance(name, str) and name else None


def _tool_key(context: Any, tool: Any) -> Any:
    call_id = getattr(context, "tool_call_id", None)
    return call_id if isinstance(call_id, str) and call_id else (id(context), id(tool))


def _handoff_tool(from_agent: Any, to_agent: Any) -> str:
    """The tool name the model called for a handoff from ``from_agent`` to ``to_agent`` (``transfer_to_<agent>``,
    or the handoff's own ``tool_name``)."""
    from agents.handoffs import Handoff

    for entry in getattr(from_agent, "handoffs", None) or []:
        if isinstance(entry, Handoff) and entry.agent_name == getattr(to_agent, "name", None):
            return entry.tool_name
    return Handoff.default_tool_name(to_agent)


def _tool_started(context: Any, agent: Any, tool: Any) -> None:
    run, state = _run.get(), current_rollout()
    if run is None or state is None:
        return
    name = getattr(context, "tool_name", None) or getattr(tool, "name", None) or type(tool).__name__
    call_id = getattr(context, "tool_call_id", None)
    run.tools[_tool_key(context, tool)] = _Tool(
        str(name), call_id if isinstance(call_id, str) and call_id else None, getattr(context, "tool_arguments", None),
        _name(agent), state, time.time_ns())
    state.framework_tool_started()


def _tool_ended(run: _Run, key: Any, *, result: Any = None, error: str | None = None) -> None:
    tool = run.tools.pop(key, None)
    if tool is None:
        return
    tool.state.framework_tool_ended()
    record_finished_tool_span(tool.name, call_id=tool.call_id, arguments=tool.arguments, result=result,
                              agent=tool.agent, start_ns=tool.start_ns, end_ns=time.time_ns(),
                              error=tool.error or error)


def _tool_failed(function_tool: Any, context: Any, error: BaseException) -> None:
    """The SDK is about to tell the model that a tool failed (or re-raise its error): the span is an error."""
    run = _run.get()
    if run is None:
        return
    key = _tool_key(context, function_tool)
    tool = run.tools.get(key)
    if tool is None:  # the context the tool function gets may be a copy without the call id: by name, if one
        named = [t for t in run.tools.values() if t.name == getattr(function_tool, "name", None)]
        tool = named[0] if len(named) == 1 else None
    if tool is not None:
        tool.error = f"{type(error).__name__}: {error}"[:2000]


def _run_ended(run: _Run, error: BaseException | None) -> None:
    """Tools the run left open (a tool whose error ended it): closed with the run's error."""
    message = f"{type(error).__name__}: {error}"[:2000] if error is not None else "the run ended before the tool did"
    for key in list(run.tools):
        _tool_ended(run, key, error=message)


def _hooks_class() -> type:
    from agents.lifecycle import RunHooks, RunHooksBase

    class RolloutHooks(RunHooks):
        """Ours, in front of the program's own run hooks: each method does ours (never raising), then the
        program's, as the SDK would have called it."""

        def __init__(self, inner: Any) -> None:
            self._lightning_rl_inner = inner

        def __getattr__(self, name: str) -> Any:  # the program's own attributes on its hooks object
            if name == "_lightning_rl_inner":
                raise AttributeError(name)
            return getattr(self._lightning_rl_inner, name)

        async def on_llm_start(self, context: Any, agent: Any, *args: Any, **kwargs: Any) -> None:
            try:
                run = _run.get()
                if run is not None:
                    run.agent = _name(agent)
            except Exception as exc:
                report_failure("openai-agents agent name", exc)
            await self._lightning_rl_inner.on_llm_start(context, agent, *args, **kwargs)

        async def on_tool_start(self, context: Any, agent: Any, tool: Any, *args: Any, **kwargs: Any) -> None:
            try:
                _tool_started(context, agent, tool)
            except Exception as exc:
                report_failure("openai-agents tool span", exc)
            await self._lightning_rl_inner.on_tool_start(context, agent, tool, *args, **kwargs)

        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any, *args: Any,
                              **kwargs: Any) -> None:
            try:
                run = _run.get()
                if run is not None:
                    _tool_ended(run, _tool_key(context, tool), result=result)
            except Exception as exc:
                report_failure("openai-agents tool span", exc)
            await self._lightning_rl_inner.on_tool_end(context, agent, tool, result, *args, **kwargs)

        async def on_handoff(self, context: Any, from_agent: Any, to_agent: Any, *args: Any, **kwargs: Any) -> None:
            try:
                if _run.get() is not None and current_rollout() is not None:
                    now = time.time_ns()
                    record_finished_tool_span(_handoff_tool(from_agent, to_agent), agent=_name(from_agent),
                                              result={"assistant": _name(to_agent)}, start_ns=now, end_ns=now)
            except Exception as exc:
                report_failure("openai-agents handoff span", exc)
            await self._lightning_rl_inner.on_handoff(context, from_agent, to_agent, *args, **kwargs)

    def forward(name: str) -> Any:
        async def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self._lightning_rl_inner, name)(*args, **kwargs)

        hook.__name__ = name
        return hook

    for name in dir(RunHooksBase):  # every other hook this SDK version has: the program's, unchanged
        if name.startswith("on_") and name not in RolloutHooks.__dict__:
            setattr(RolloutHooks, name, forward(name))
    return RolloutHooks


_RolloutHooks: type | None = None


def _with_our_hooks(hooks: Any) -> Any:
    """The program's run hooks behind ours; what the SDK would refuse (not ``RunHooks``) is left for it to refuse."""
    from agents.lifecycle import AgentHooksBase, RunHooks, RunHooksBase

    assert _RolloutHooks is not None
    if isinstance(hooks, _RolloutHooks):  # a nested run handed the outer run's hooks
        return hooks
    if hooks is None:
        hooks = RunHooks()
    elif not isinstance(hooks, RunHooksBase) or isinstance(hooks, AgentHooksBase):
        return hooks
    return _RolloutHooks(hooks)


def _start(kwargs: dict[str, Any]) -> tuple[_Run, Any] | None:
    """Inside a rollout: our hooks in ``kwargs`` and a new run record for this context; else None."""
    if current_rollout() is None:
        return None
    try:
        kwargs["hooks"] = _with_our_hooks(kwargs.get("hooks"))
    except Exception as exc:  # the run goes on unrecorded, said once
        report_failure("openai-agents run hooks", exc)
        return None
    run = _Run()
    return run, _run.set(run)


def _wrap_run(original: Any) -> Any:
    @functools.wraps(original)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = _start(kwargs)
        if started is None:
            return await original(self, *args, **kwargs)
        record, token = started
        error: BaseException | None = None
        try:
            return await original(self, *args, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _run.reset(token)
            _run_ended(record, error)

    return run


def _wrap_run_streamed(original: Any) -> Any:
    @functools.wraps(original)
    def run_streamed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = _start(kwargs)
        if started is None:
            return original(self, *args, **kwargs)
        record, token = started
        try:  # the run's task copies this context, with our record, as it is created here
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            _run_ended(record, exc)
            raise
        finally:
            _run.reset(token)
        task = getattr(result, "run_loop_task", None) or getattr(result, "_run_impl_task", None)
        if task is not None and hasattr(task, "add_done_callback"):
            task.add_done_callback(lambda done: _run_ended(record, None if done.cancelled() else done.exception()))
        return result

    return run_streamed


def _wrap_failure_function(original: Any) -> Any:
    @functools.wraps(original)
    async def failure(*args: Any, **kwargs: Any) -> Any:
        try:
            _tool_failed(kwargs.get("function_tool"), kwargs.get("context"), kwargs.get("error"))
        except Exception as exc:
            report_failure("openai-agents tool error", exc)
        return await original(*args, **kwargs)

    return failure


def _replace(owner: Any, attr: str, wrapper: Any) -> bool:
    original = getattr(owner, attr, None)
    if original is None:
        return False
    if not getattr(original, _MARK, False):
        wrapped = wrapper(original)
        setattr(wrapped, _MARK, True)
        setattr(owner, attr, wrapped)
    return True


def instrument() -> bool:
    """Put our run hooks in front of every run inside a rollout, and name agents from them (once per process)."""
    global _RolloutHooks
    try:
        import agents.tool
        from agents.run import AgentRunner
    except ImportError:
        return False
    if _RolloutHooks is None:
        _RolloutHooks = _hooks_class()
    _replace(AgentRunner, "run", _wrap_run)
    _replace(AgentRunner, "run_streamed", _wrap_run_streamed)
    # where the SDK turns a tool's exception into the model's failure message (its tool invoker looks it up here)
    if not _replace(agents.tool, "maybe_invoke_function_tool_failure_error_function", _wrap_failure_function):
        report_failure("openai-agents tool error", message=(
            "lightning-rl: this openai-agents version has no agents.tool.maybe_invoke_function_tool_failure_error_"
            "function, so a tool whose failure the SDK tells the model is recorded with that message as its result, "
            "not as an error; lightning-rl is tested with openai-agents 0.24.0. Counted (logged once)"))
    register_agent_resolver(current_agent)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
