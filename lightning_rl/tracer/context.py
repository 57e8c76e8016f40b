"""Rollout context carried by contextvars: survives ``await``, asyncio tasks and copied-context threads."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ..diagnostics import count, report_failure
from ..errors import NotInRolloutError
from ..registry import Registry


@dataclass(slots=True, eq=False)
class RolloutState:
    """Mutable per-rollout bookkeeping shared by every span of one rollout."""

    rollout_id: str
    name: str
    agent: str | None
    mode: str
    policy_version: int | None
    group_id: str | None = None
    attempt: int = 0
    seq: Iterator[int] = field(default_factory=itertools.count)
    llm_call_counter: Iterator[int] = field(default_factory=itertools.count)
    llm_calls: int = 0  # LLM calls recorded (a rollout that ends with none is counted and reported)
    last_llm_call: int | None = None  # index of the latest LLM call that finished
    last_llm_call_by_agent: dict[str, int] = field(default_factory=dict)
    open_calls: dict[int, Any] = field(default_factory=dict)  # in-flight LLM calls (streams)
    oldest_call_version: int | None = None  # the rollout's version when it ends
    sampling: dict[str, Any] | None = None  # imposed on every LLM request (rollout_overrides(sampling=))
    lock: threading.Lock = field(default_factory=threading.Lock)
    # (name, arguments, id, agent) of the tool calls the model asked for and no tool span has claimed yet:
    # a framework whose tool hook has no call id gets it, and the agent that asked, from here (claim_tool_call)
    tool_calls_asked: list[tuple[str, str, str, str | None]] = field(default_factory=list)
    # tools a framework adapter is running now and will record as its own span (framework_tool_started):
    # a lower layer (an MCP client session) that sees the same call records no second span for it
    framework_tools: int = 0

    def framework_tool_started(self) -> None:
        """A framework adapter started running a tool it records as a tool span (pair with ``..._ended``)."""
        with self.lock:
            self.framework_tools += 1

    def framework_tool_ended(self) -> None:
        with self.lock:
            self.framework_tools = max(0, self.framework_tools - 1)

    def next_llm_call(self) -> int:
        self.llm_calls += 1
        return next(self.llm_call_counter)

    def note_tool_calls(self, calls: list[tuple[str, str, str]], agent: str | None = None) -> None:
        """The tool calls (name, arguments, id) an LLM call of this rollout, made by ``agent``, answered with."""
        with self.lock:
            self.tool_calls_asked.extend((name, arguments, call_id, agent) for name, arguments, call_id in calls)
            del self.tool_calls_asked[:-64]  # the recent ones are the ones a tool runs for

    def claim_tool_call(self, name: str, arguments: Any = None) -> tuple[str, str | None] | None:
        """The id of the oldest unclaimed tool call of ``name`` (with these arguments, when they match one),
        and the agent whose LLM call asked for it, for a tool span whose framework does not say them; None
        if the model asked for none."""
        with self.lock:
            candidates = [i for i, asked in enumerate(self.tool_calls_asked) if asked[0] == name]
            if not candidates:
                return None
            chosen = candidates[0]
            if isinstance(arguments, str):
                wanted = _normal_arguments(arguments)
                chosen = next((i for i in candidates if _normal_arguments(self.tool_calls_asked[i][1]) == wanted), chosen)
            _, _, call_id, agent = self.tool_calls_asked.pop(chosen)
            return call_id, agent

    def note_end(self) -> None:
        """A rollout that ends without any LLM call recorded trains nothing: counted, and said once."""
        if self.llm_calls:
            return
        count("rollouts_without_llm_calls")
        report_failure("rollout without llm calls", message=(
            f"lightning-rl: rollout {self.rollout_id} of {self.name!r} ended with no LLM call recorded, so it gives "
            "no training sample. If the agent called a model, the call did not go through a client lightning-rl "
            "records (lrl.stats() shows llm_calls_bypassing_capture when it was seen at the HTTP layer): send it "
            "through the gateway or the openai client. Counted as rollouts_without_llm_calls (logged once)"))

    def call_version(self, version: int) -> int:
        """Note the policy version an LLM call of this rollout is stamped with; returns it."""
        with self.lock:
            if self.oldest_call_version is None or version < self.oldest_call_version:
                self.oldest_call_version = version
        return version

    def llm_call_finished(self, index: int, agent: str | None) -> None:
        with self.lock:
            if self.last_llm_call is None or index > self.last_llm_call:
                self.last_llm_call = index
            if agent is not None:
                prev = self.last_llm_call_by_agent.get(agent)
                if prev is None or index > prev:
                    self.last_llm_call_by_agent[agent] = index


@dataclass(slots=True, eq=False)
class LLMHint:
    """Set by a framework adapter just before its model makes an LLM call (e.g. LangChain's
    ``on_chat_model_start``): which agent is calling and under which span, so the OpenAI adapter's
    span for that call carries both the framework's view and the engine's token ids."""

    agent: str | None
    parent: Any = None  # an OpenTelemetry span of ours, or None
    framework_run_id: str | None = None
    recorded: int = 0  # LLM calls the OpenAI adapter recorded under this hint


_rollout: ContextVar[RolloutState | None] = ContextVar("lightning_rl_rollout", default=None)
_agent: ContextVar[str | None] = ContextVar("lightning_rl_agent", default=None)
_our_span: ContextVar[Any] = ContextVar("lightning_rl_span", default=None)  # our innermost span
_llm_hint: ContextVar[LLMHint | None] = ContextVar("lightning_rl_llm_hint", default=None)


def current_rollout() -> RolloutState | None:
    """The active rollout, or None outside any traced call."""
    return _rollout.get()


def require_rollout(what: str) -> RolloutState:
    state = _rollout.get()
    if state is None:
        raise NotInRolloutError(
            f"{what} was called outside any rollout; call it inside a function decorated with "
            "@lightning_rl.trace (or use store.add_reward(rollout_id, ...) after the rollout ended)"
        )
    return state


def set_llm_hint(hint: LLMHint | None) -> None:
    """Adapters set the hint for the LLM call about to be made in this context (None clears it)."""
    _llm_hint.set(hint)


def current_llm_hint() -> LLMHint | None:
    return _llm_hint.get()


_resolvers_lock = threading.Lock()
#: Adapters of frameworks that keep their own agent context (the OpenAI Agents SDK's current span,
#: PydanticAI's agent run) register a function that names the agent running now, or None. Ordered: the
#: first registered is asked first, and the first name one gives is the agent's.
AGENT_RESOLVERS: Registry[Callable[[], str | None]] = Registry(
    "agent-name resolver", ordered=True, hint="register one with lightning_rl.tracer.context.register_agent_resolver")


def register_agent_resolver(resolver: Callable[[], str | None], *, name: str | None = None) -> None:
    """Ask ``resolver()`` for the agent's name after ``agent_scope`` (idempotent: registering the same function
    again does nothing). ``name``: its registry name, by default ``module.qualname``; another function under a
    name taken is refused (``ConfigurationError``)."""
    name = name or f"{getattr(resolver, '__module__', None)}.{getattr(resolver, '__qualname__', repr(resolver))}"
    with _resolvers_lock:  # two frameworks' adapters may be instrumented at once (imports in two threads)
        if AGENT_RESOLVERS.get(name, None) is not resolver:
            AGENT_RESOLVERS.add(name, resolver)


def current_agent_name() -> str | None:
    """The innermost agent name: agent_scope(), then a framework's own (its adapter's resolver), then
    the traced function's agent."""
    name = _agent.get()
    if name is not None:
        return name
    for resolver in AGENT_RESOLVERS.values():
        try:
            name = resolver()
        except Exception as exc:  # a framework's internals changed: the name falls back, said once
            report_failure(f"agent name from {getattr(resolver, '__module__', resolver)}", exc)
            name = None
        if name:
            return name
    state = _rollout.get()
    return state.agent if state is not None else None


def _normal_arguments(arguments: Any) -> Any:
    """Tool arguments compared by their JSON value, not their spacing."""
    import orjson

    try:
        return orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        return arguments


@contextlib.contextmanager
def rollout_scope(state: RolloutState, agent: str | None = None) -> Iterator[None]:
    """Make ``state`` the active rollout (and ``agent`` the calling agent) for the block: for a rollout
    whose calls arrive one by one from outside this process (the gateway)."""
    rollout_token = _rollout.set(state)
    agent_token = _agent.set(agent)
    try:
        yield
    finally:
        _agent.reset(agent_token)
        _rollout.reset(rollout_token)


@contextlib.contextmanager
def agent_scope(name: str) -> Iterator[None]:
    """Name the agent for every LLM call made inside (also across awaits and copied-context threads).

    Inside a rollout this also opens an ``invoke_agent {name}`` span, so the agent's LLM and tool
    calls become its children. Outside a rollout it only sets the name.
    """
    if not isinstance(name, str) or not name:
        from ..errors import ConfigurationError

        raise ConfigurationError(f"agent_scope() needs a non-empty agent name, got {name!r}")
    from .provider import agent_span  # late: provider imports this module

    token = _agent.set(name)
    try:
        with agent_span(name):
            yield
    finally:
        _agent.reset(token)


class ToolSpan:
    """What ``tool_span`` yields: set ``result`` (any JSON-able value) before the block ends."""

    __slots__ = ("result",)

    def __init__(self) -> None:
        self.result: Any = None


@contextlib.contextmanager
def tool_span(name: str, *, call_id: str | None = None, arguments: Any = None) -> Iterator[ToolSpan]:
    """Record a tool call made by plain code as an ``execute_tool {name}`` span (frameworks' tool
    calls are recorded by their adapters). Inside a rollout only; elsewhere it does nothing."""
    from .provider import record_tool_span  # late: provider imports this module

    handle = ToolSpan()
    with record_tool_span(name, call_id, arguments, handle):
        yield handle
