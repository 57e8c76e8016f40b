"""LangChain / LangGraph adapter: zero-code agent, chain and tool spans, agent names on LLM calls.

``instrument()`` registers one inline callback handler with LangChain's configure hook, so every
callback manager includes it without ``callbacks=[...]`` in user code. Outside a rollout it does
nothing. Inside one:

* the top-level run becomes a span (``invoke_agent {name}`` for an agent, else
  ``invoke_workflow {name}``); an agent boundary (``create_agent(name=...)`` sets
  ``lc_agent_name``) becomes ``invoke_agent {name}``; a LangGraph node becomes a span named after
  the node. Internal runnables get no span of their own, their children attach to the nearest one.
* every tool run becomes ``execute_tool {tool}`` with ``gen_ai.tool.call.id``, its arguments and
  its result.
* every chat model run sets an LLM hint (agent name, parent span, run id) that the OpenAI adapter
  uses, so one LLM call is one span with the agent name *and* the engine's token ids (LangChain
  itself drops the ids). A model call the OpenAI adapter never saw (another provider) is still
  recorded from LangChain's result, marked ``token_ids.source = missing``.

The agent name of an LLM call is ``lc_agent_name``, else the LangGraph node, else the enclosing
``agent_scope`` / traced function. Handler failures are logged once and counted; they never
reach the agent.
"""

from __future__ import annotations

import functools
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import orjson

try:
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.tracers.context import register_configure_hook
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the LangChain adapter needs langchain-core: pip install 'lightning-rl[langchain]'"
    ) from exc

from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import semconv
from ..diagnostics import count, report_failure
from ..tracer.context import LLMHint, _rollout, current_agent_name, current_llm_hint, set_llm_hint
from ..tracer.provider import parent_context, tracing

_MAX_TEXT = 4000


def _text(value: Any) -> str:
    content = getattr(value, "content", value)
    text = content if isinstance(content, str) else orjson.dumps(content, default=repr).decode()
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def _never_raises(cause: str):
    """Handler methods log and count their failures (once per cause) instead of raising into the agent."""

    def wrap(method):
        @functools.wraps(method)
        def safe(self, *args: Any, **kwargs: Any) -> None:
            try:
                method(self, *args, **kwargs)
            except Exception as exc:
                report_failure(cause, exc)

        return safe

    return wrap


@dataclass(slots=True, eq=False)
class _Run:
    span: Any  # our span for this run, or None when the run has none of its own
    parent: "_Run | None"
    agent: str | None
    rollout_id: str
    tool_of: Any = None  # a tool run's rollout state: the framework tool it counts ends with the run

    def nearest_span(self) -> Any:
        run: _Run | None = self
        while run is not None:
            if run.span is not None:
                return run.span
            run = run.parent
        return None


class LightningRLCallbackHandler(BaseCallbackHandler):
    """Registered once per process by :func:`instrument`. Runs inline (same thread and context)."""

    run_inline = True
    raise_error = False

    def __init__(self) -> None:
        self._runs: dict[UUID, _Run] = {}
        self._hints: dict[UUID, LLMHint] = {}
        self._lock = threading.Lock()

    # -- bookkeeping ------------------------------------------------------------------------------
    def _parent(self, parent_run_id: UUID | None) -> _Run | None:
        return self._runs.get(parent_run_id) if parent_run_id is not None else None

    def _start_span(self, name: str, parent: _Run | None, attributes: dict[str, Any], kind=SpanKind.INTERNAL) -> Any:
        span_parent = parent.nearest_span() if parent is not None else None
        return tracing.tracer.start_span(name, kind=kind, attributes=attributes, context=parent_context(span_parent))

    def _end(self, run_id: UUID, error: BaseException | None = None, result: Any = None) -> None:
        with self._lock:
            run = self._runs.pop(run_id, None)
        if run is not None and run.tool_of is not None:
            run.tool_of.framework_tool_ended()
        if run is None or run.span is None:
            return
        if result is not None:
            run.span.set_attribute(semconv.TOOL_RESULT, _text(result))
        if error is not None:
            run.span.record_exception(error)
            run.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        run.span.end()

    # -- chains, agents, graph nodes --------------------------------------------------------------
    @_never_raises("langchain chain start")
    def on_chain_start(self, serialized: dict[str, Any] | None, inputs: Any, *, run_id: UUID,
                       parent_run_id: UUID | None = None, tags: list[str] | None = None,
                       metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        state = _rollout.get()
        if state is None:
            return
        metadata = metadata or {}
        parent = self._parent(parent_run_id)
        name = kwargs.get("name") or (serialized or {}).get("name") or "chain"
        agent = metadata.get("lc_agent_name")
        node = metadata.get("langgraph_node")
        inherited = parent.agent if parent is not None else None
        span = None
        if parent is None or (agent and agent != inherited):
            op = semconv.OP_INVOKE_AGENT if agent else "invoke_workflow"
            attrs = {semconv.GEN_AI_OPERATION_NAME: op}
            if agent:
                attrs[semconv.GEN_AI_AGENT_NAME] = agent
            span = self._start_span(f"{op} {agent or name}", parent, attrs)
        elif node and name == node:
            attrs = {semconv.LANGGRAPH_NODE: node}
            if agent or inherited:
                attrs[semconv.GEN_AI_AGENT_NAME] = agent or inherited
            span = self._start_span(node, parent, attrs)
        with self._lock:
            self._runs[run_id] = _Run(span, parent, agent or inherited, state.rollout_id)

    @_never_raises("langchain chain end")
    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)

    @_never_raises("langchain chain error")
    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, error=error)

    # -- tools --------------------------------------------------------------------------------------
    @_never_raises("langchain tool start")
    def on_tool_start(self, serialized: dict[str, Any] | None, input_str: str, *, run_id: UUID,
                      parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None,
                      inputs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        state = _rollout.get()
        if state is None:
            return
        parent = self._parent(parent_run_id)
        tool = (serialized or {}).get("name") or kwargs.get("name") or "tool"
        attrs: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
            semconv.GEN_AI_TOOL_NAME: tool,
            semconv.TOOL_ARGUMENTS: _text(inputs if inputs is not None else input_str),
        }
        call_id = kwargs.get("tool_call_id")
        if call_id:
            attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
        agent = (metadata or {}).get("lc_agent_name") or (parent.agent if parent else None) or current_agent_name()
        if agent:
            attrs[semconv.GEN_AI_AGENT_NAME] = agent
        span = self._start_span(f"execute_tool {tool}", parent, attrs)
        with self._lock:
            self._runs[run_id] = _Run(span, parent, agent, state.rollout_id, tool_of=state)
        state.framework_tool_started()  # an MCP call the tool makes is this span's (adapters/mcp.py)

    @_never_raises("langchain tool end")
    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, result=output)

    @_never_raises("langchain tool error")
    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, error=error)

    # -- models -------------------------------------------------------------------------------------
    def _model_start(self, run_id: UUID, parent_run_id: UUID | None, metadata: dict[str, Any] | None) -> None:
        state = _rollout.get()
        if state is None:
            return
        parent = self._parent(parent_run_id)
        metadata = metadata or {}
        agent = (metadata.get("lc_agent_name") or (parent.agent if parent else None)
                 or metadata.get("langgraph_node") or current_agent_name())
        hint = LLMHint(agent=agent, parent=parent.nearest_span() if parent else None, framework_run_id=str(run_id))
        with self._lock:
            self._runs[run_id] = _Run(None, parent, agent, state.rollout_id)
            self._hints[run_id] = hint
        set_llm_hint(hint)

    @_never_raises("langchain model start")
    def on_chat_model_start(self, serialized: dict[str, Any] | None, messages: Any, *, run_id: UUID,
                            parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None,
                            **kwargs: Any) -> None:
        self._model_start(run_id, parent_run_id, metadata)

    @_never_raises("langchain model start")
    def on_llm_start(self, serialized: dict[str, Any] | None, prompts: list[str], *, run_id: UUID,
                     parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None,
                     **kwargs: Any) -> None:
        self._model_start(run_id, parent_run_id, metadata)

    @_never_raises("langchain model end")
    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        hint, run = self._model_end(run_id)
        if hint is not None and hint.recorded == 0 and _rollout.get() is not None:
            self._record_unseen_call(hint, run, response)

    @_never_raises("langchain model error")
    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._model_end(run_id)

    def _model_end(self, run_id: UUID) -> tuple[LLMHint | None, _Run | None]:
        with self._lock:
            hint = self._hints.pop(run_id, None)
            run = self._runs.pop(run_id, None)
        if hint is not None and current_llm_hint() is hint:
            set_llm_hint(None)
        return hint, run

    def _record_unseen_call(self, hint: LLMHint, run: _Run | None, response: Any) -> None:
        """An LLM call that did not go through the OpenAI client: keep it, without token ids."""
        state = _rollout.get()
        index = state.next_llm_call()
        texts = [g.text for gens in getattr(response, "generations", []) for g in gens]
        attrs = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.LLM_CALL_INDEX: index,
            semconv.ROLLOUT_ID: state.rollout_id,
            semconv.TOKEN_IDS_SOURCE: semconv.SOURCE_MISSING,
            semconv.FRAMEWORK_RUN_ID: hint.framework_run_id or "",
            semconv.GEN_AI_OUTPUT_MESSAGES: orjson.dumps([{"role": "assistant", "content": "".join(texts)}]).decode(),
            semconv.POLICY_VERSION: state.call_version(tracing.policy_version()),
        }
        if hint.agent:
            attrs[semconv.GEN_AI_AGENT_NAME] = hint.agent
        span = tracing.tracer.start_span("chat unknown", kind=SpanKind.CLIENT, attributes=attrs,
                                         context=parent_context(hint.parent))
        span.end()
        state.llm_call_finished(index, hint.agent)
        count("llm_calls_without_token_ids")
        report_failure(
            "langchain model outside the OpenAI client",
            message="lightning-rl: a LangChain model call did not go through the OpenAI client; it is "
            "recorded without token ids (use ChatOpenAI with base_url pointing at vLLM to train on it)",
        )


_handler_var: ContextVar[LightningRLCallbackHandler | None] = ContextVar("lightning_rl_langchain_handler", default=None)
_handler: LightningRLCallbackHandler | None = None


def instrument() -> LightningRLCallbackHandler:
    """Register the handler with LangChain's configure hook (once per process; idempotent)."""
    global _handler, _handler_var
    if _handler is None:
        handler = LightningRLCallbackHandler()
        _handler_var = ContextVar("lightning_rl_langchain_handler", default=handler)
        register_configure_hook(_handler_var, True)
        _handler = handler
    return _handler


def instrument_framework() -> bool:
    """The framework registry's entry (``lightning_rl.adapters.FRAMEWORKS``: ``instrument() -> bool``)."""
    instrument()
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
