"""Wrapping a framework's public methods where it has no hook before a model call or around a tool (as
OpenTelemetry's own instrumentations of smolagents, CrewAI and LlamaIndex do).

``name_agent(cls, "run", name_of)``: the method runs inside ``agent_scope(name_of(self))``, so each LLM call
made inside carries that name (a generator or coroutine it returns is named while it runs).
``record_tool(cls, "__call__", name_of, arguments_of, result_of)``: each call is an ``execute_tool {name}``
span with its arguments and result; its call id is the model's matching tool call.

Outside a rollout both only call through; a method is wrapped once, whatever calls it again. Tracing never
raises into the framework: a name or argument that cannot be read leaves the call unrecorded, said once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from typing import Any

from ..diagnostics import report_failure
from ..tracer.context import agent_scope, current_rollout, tool_span

_MARK = "__lightning_rl__"
# the tool whose span is open: a framework's layers of one tool call (a structured tool calling the tool's
# own run) are one span, not one per layer
_open_tool: ContextVar[Any] = ContextVar("lightning_rl_open_tool", default=None)


def _replace(cls: type, attr: str, wrapper: Callable[[Any], Any]) -> None:
    original = cls.__dict__.get(attr)
    if original is None or getattr(original, _MARK, False):
        return
    wrapped = wrapper(original)
    setattr(wrapped, _MARK, True)
    setattr(cls, attr, wrapped)


def _name(name_of: Callable[[Any], str | None], framework_object: Any) -> str | None:
    if current_rollout() is None:
        return None
    try:
        name = name_of(framework_object)
    except Exception as exc:
        report_failure(f"agent name of {type(framework_object).__name__}", exc)
        return None
    return name if isinstance(name, str) and name else None


def _named_steps(steps: Iterator[Any], name: str) -> Iterator[Any]:
    with agent_scope(name):
        yield from steps


async def _named_async_steps(steps: AsyncIterator[Any], name: str) -> AsyncIterator[Any]:
    with agent_scope(name):
        async for step in steps:
            yield step


async def _named_awaitable(awaitable: Any, name: str) -> Any:
    with agent_scope(name):
        return await awaitable


def name_agent(cls: type, attr: str, name_of: Callable[[Any], str | None]) -> None:
    """Run ``cls.attr`` (sync or async) inside ``agent_scope`` of its object's name."""

    def wrapper(original: Any) -> Any:
        if inspect.iscoroutinefunction(original):
            @functools.wraps(original)
            async def named_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                name = _name(name_of, self)
                if name is None:
                    return await original(self, *args, **kwargs)
                with agent_scope(name):
                    return await original(self, *args, **kwargs)

            return named_async

        @functools.wraps(original)
        def named(self: Any, *args: Any, **kwargs: Any) -> Any:
            name = _name(name_of, self)
            if name is None:
                return original(self, *args, **kwargs)
            with agent_scope(name):
                result = original(self, *args, **kwargs)
            if inspect.isgenerator(result):
                return _named_steps(result, name)
            if inspect.isasyncgen(result):
                return _named_async_steps(result, name)
            if inspect.iscoroutine(result):
                return _named_awaitable(result, name)
            return result

        return named

    _replace(cls, attr, wrapper)


def _storable(result: Any) -> Any:
    return result if result is None or isinstance(result, (str, int, float, bool, list, dict)) else str(result)


def record_tool(cls: type, attr: str, name_of: Callable[[Any], str], arguments_of: Callable[..., Any],
                result_of: Callable[[Any], Any] = _storable) -> None:
    """Record each call of ``cls.attr`` (sync or async) as a tool span. ``arguments_of(self, args, kwargs)``
    gives the arguments as the model sent them; ``result_of(result)`` what the model is told."""

    def opened(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any] | None:
        state = current_rollout()
        if state is None:
            return None
        try:
            name = str(name_of(self))
            if _open_tool.get() == name:  # an inner layer of the call already recorded
                return None
            span = tool_span(name, arguments=arguments_of(self, args, kwargs))
            handle = span.__enter__()
            token = _open_tool.set(name)
            state.framework_tool_started()  # an MCP call the tool makes is this span's (adapters/mcp.py)
            return span, handle, token
        except Exception as exc:  # the tool runs unrecorded
            report_failure(f"tool span of {type(self).__name__}", exc)
            return None

    def ended(token: Any) -> None:
        _open_tool.reset(token)
        state = current_rollout()
        if state is not None:
            state.framework_tool_ended()

    def closed(span: Any, handle: Any, token: Any, result: Any) -> None:
        ended(token)
        try:
            handle.result = result_of(result)
        except Exception as exc:
            report_failure("tool result", exc)
        span.__exit__(None, None, None)

    def failed(span: Any, token: Any, exc: BaseException) -> None:
        ended(token)
        span.__exit__(type(exc), exc, exc.__traceback__)  # on the span; the caller raises it as it was

    def wrapper(original: Any) -> Any:
        if inspect.iscoroutinefunction(original):
            @functools.wraps(original)
            async def recorded_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                entered = opened(self, args, kwargs)
                if entered is None:
                    return await original(self, *args, **kwargs)
                try:
                    result = await original(self, *args, **kwargs)
                except BaseException as exc:
                    failed(entered[0], entered[2], exc)
                    raise
                closed(*entered, result)
                return result

            return recorded_async

        @functools.wraps(original)
        def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
            entered = opened(self, args, kwargs)
            if entered is None:
                return original(self, *args, **kwargs)
            try:
                result = original(self, *args, **kwargs)
            except BaseException as exc:
                failed(entered[0], entered[2], exc)
                raise
            closed(*entered, result)
            return result

        return recorded

    _replace(cls, attr, wrapper)
