"""AutoGen adapter (autogen-agentchat / autogen-core 0.7.x): agent and tool spans, agent names.

AutoGen opens its own GenAI spans through three context managers, ``trace_invoke_agent_span``
(single agents' ``run``/``run_stream`` and every team participant), and ``trace_tool_span``
(``BaseTool.run_json``). They use the *global* provider, so without one they are no-ops, and with
one they are the user's spans. ``instrument()`` wraps them where AutoGen calls them: AutoGen's own
span is still made exactly as before, and inside a rollout we also open ours:

* ``invoke_agent {participant}``, which names the agent for every LLM call made inside it (so in
  teams, each call carries the participant that made it);
* ``execute_tool {tool}`` with ``gen_ai.tool.call.id``;
* the selector of a ``SelectorGroupChat`` calls the model as agent ``selector``.

LLM calls themselves (and their engine token ids, streaming included) come from the OpenAI
adapter, since ``OpenAIChatCompletionClient`` calls ``AsyncOpenAI``. Our spans always parent to our
own spans, so the rollout tree is the same whether or not a global provider is set.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

try:
    from autogen_agentchat.agents import _base_chat_agent as _agent_module
    from autogen_agentchat.teams._group_chat import _chat_agent_container as _container_module
    from autogen_agentchat.teams._group_chat import _selector_group_chat as _selector_module
    from autogen_core.tools import _base as _tools_module
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the AutoGen adapter needs autogen-agentchat 0.7: pip install 'lightning-rl[autogen]'") from exc

from opentelemetry import trace as otel_trace
from opentelemetry.trace import Status, StatusCode

from .. import semconv
from ..diagnostics import report_failure
from ..tracer.context import _agent, _our_span, _rollout, current_agent_name
from ..tracer.provider import parent_context, tracing

_MARK = "__lightning_rl_original__"


@contextlib.contextmanager
def _ours(name: str, attributes: dict[str, Any], agent: str | None) -> Iterator[Any]:
    """Our span, made current and our innermost for the block; ``agent`` names the agent inside."""
    try:
        span = tracing.tracer.start_span(name, context=parent_context(), attributes=attributes)
    except Exception as exc:
        report_failure("autogen span", exc)
        yield None
        return
    agent_token = _agent.set(agent) if agent is not None else None
    span_token = _our_span.set(span)
    # a tool's span: an MCP call the tool makes is this span's, not a second one (adapters/mcp.py)
    tool_state = _rollout.get() if attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL else None
    if tool_state is not None:
        tool_state.framework_tool_started()
    try:
        yield span
    except BaseException as error:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        raise
    finally:
        if tool_state is not None:
            tool_state.framework_tool_ended()
        span.end()
        for var, token in ((_our_span, span_token), (_agent, agent_token)):
            if token is not None:
                try:
                    var.reset(token)
                except ValueError:  # an async generator resumed in another context
                    pass


def _wrap_span_factory(original: Callable[..., Any], make: Callable[..., tuple[str, dict[str, Any], str | None]]) -> Any:
    """Wrap one of AutoGen's span context managers: theirs as before, ours inside a rollout."""

    @contextlib.contextmanager
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if _rollout.get() is None:
            with original(*args, **kwargs) as theirs:
                yield theirs
            return
        name, attributes, agent = make(*args, **kwargs)
        with _ours(name, attributes, agent) as ours, original(*args, **kwargs) as theirs:
            if ours is None:
                yield theirs
            else:  # theirs became current; calls inside must parent to ours
                with otel_trace.use_span(ours, end_on_exit=False):
                    yield theirs

    setattr(wrapper, _MARK, original)
    return wrapper


def _agent_span_args(agent_name: str, *, agent_id: str | None = None, **_: Any) -> tuple[str, dict[str, Any], str]:
    attrs = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: agent_name}
    if agent_id:
        attrs["gen_ai.agent.id"] = agent_id
    return f"invoke_agent {agent_name}", attrs, agent_name


def _tool_span_args(tool_name: str, *, tool_call_id: str | None = None, **_: Any) -> tuple[str, dict[str, Any], None]:
    attrs = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.GEN_AI_TOOL_NAME: tool_name}
    if tool_call_id:
        attrs[semconv.GEN_AI_TOOL_CALL_ID] = tool_call_id
    agent = current_agent_name()
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return f"execute_tool {tool_name}", attrs, None


def _wrap_selector(original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    async def select_speaker(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None:
            return await original(self, *args, **kwargs)
        token = _agent.set("selector")
        try:
            return await original(self, *args, **kwargs)
        finally:
            _agent.reset(token)

    setattr(select_speaker, _MARK, original)
    return select_speaker


def instrument() -> bool:
    """Wrap AutoGen's agent and tool span helpers where AutoGen calls them (idempotent)."""
    for module in (_agent_module, _container_module):
        current = module.trace_invoke_agent_span
        if not hasattr(current, _MARK):
            module.trace_invoke_agent_span = _wrap_span_factory(current, _agent_span_args)
    current = _tools_module.trace_tool_span
    if not hasattr(current, _MARK):
        _tools_module.trace_tool_span = _wrap_span_factory(current, _tool_span_args)
    manager = _selector_module.SelectorGroupChatManager
    if not hasattr(manager._select_speaker, _MARK):
        manager._select_speaker = _wrap_selector(manager._select_speaker)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
