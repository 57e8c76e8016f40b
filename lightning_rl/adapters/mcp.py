"""MCP (the ``mcp`` Python SDK, 2.x): each tool call made through a client session is a tool span.

Every MCP client, over any transport (stdio, streamable HTTP, in-process), calls the server's tools through
``mcp.ClientSession.call_tool``: ``mcp.Client``, ``ClientSessionGroup``, FastMCP's client (PydanticAI's
``MCPServerStdio``/``MCPServerStreamableHTTP``) and the OpenAI Agents SDK's MCP servers all do. So this adapter
wraps that one method, once, when ``mcp`` is imported. Inside a rollout each call is an ``execute_tool {name}``
span with:

* the arguments sent, and the result: the ``CallToolResult``'s ``structuredContent`` where the server sent
  one, else its content (the text of a text-only result, else the content blocks as JSON);
* an error status: with the exception's type and message when the call raised (a protocol error, a timeout,
  a result that breaks the tool's output schema), and with the result's text when the server answered
  ``isError: true`` (a tool that failed); the caller gets the exception or the result unchanged;
* the model's call id, and the agent that asked, from the rollout's LLM answers (the session never knows
  them: ``claim_tool_call``), so the call and its result link up;
* ``mcp.method.name`` (``tools/call``), ``mcp.protocol.version`` and the server's name as it introduced itself
  (``lightning_rl.mcp.server.name``), where the session knows them.

A call made inside a tool that a framework adapter records as its own span (LangChain, AutoGen, smolagents,
CrewAI, LlamaIndex, PydanticAI, the Agents SDK: ``RolloutState.framework_tools``) records no second span:
the framework's span, with the framework's call id, is the tool call. A call the server answers with
``InputRequiredResult`` (it needs input first) is recorded once, at the round that completes it.

Outside a rollout the wrapper only calls through; tracing never raises into the caller.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from .. import semconv
from ..diagnostics import report_failure
from ..tracer.context import current_rollout
from ..tracer.provider import record_finished_tool_span
from .wrapping import _replace

_MAX_ERROR = 2000
_not_done: tuple[type, ...] = ()  # mcp 2.x's InputRequiredResult (set by instrument)


def _call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The tool's name and arguments, however ``call_tool(name, arguments, ...)`` was called."""
    name = kwargs["name"] if "name" in kwargs else (args[0] if args else None)
    arguments = kwargs["arguments"] if "arguments" in kwargs else (args[1] if len(args) > 1 else None)
    return name, arguments


def _texts(content: Any) -> list[str] | None:
    """The texts of a text-only content list, else None."""
    texts = [getattr(block, "text", None) for block in content or []]
    return texts if texts and all(isinstance(text, str) for text in texts) else None


def _result(result: Any) -> Any:
    """What the span records as the result: structured content, else the text, else the content as JSON."""
    structured = getattr(result, "structured_content", getattr(result, "structuredContent", None))  # 2.x, 1.x
    if structured is not None:
        return structured
    content = getattr(result, "content", None)
    if content is None:  # a claimed extension result (allow_claimed=True): the result as sent
        return result.model_dump(mode="json", by_alias=True, exclude_none=True)
    texts = _texts(content)
    if texts is not None:
        return "\n".join(texts)
    return [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in content]


def _error_text(result: Any) -> str:
    texts = _texts(getattr(result, "content", None))
    text = "\n".join(texts) if texts else "the tool returned isError with no text"
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


def _session_attributes(session: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {semconv.MCP_METHOD_NAME: "tools/call"}
    version = getattr(session, "protocol_version", None)
    if isinstance(version, str) and version:
        attrs[semconv.MCP_PROTOCOL_VERSION] = version
    name = getattr(getattr(session, "server_info", None), "name", None)
    if isinstance(name, str) and name:
        attrs[semconv.MCP_SERVER_NAME] = name
    return attrs


def _record(session: Any, name: Any, arguments: Any, start_ns: int, result: Any = None,
            raised: BaseException | None = None) -> None:
    """The finished call as a tool span (never raises: a failure is logged once and counted)."""
    try:
        if raised is None and isinstance(result, _not_done):
            return  # not done: the caller sends its input and calls again, and that round is recorded
        error = None
        if raised is not None:
            error = f"{type(raised).__name__}: {raised}"[:_MAX_ERROR]
        elif getattr(result, "is_error", getattr(result, "isError", False)):
            error = _error_text(result)
        record_finished_tool_span(
            str(name), arguments=arguments, result=None if raised is not None else _result(result),
            start_ns=start_ns, end_ns=time.time_ns(), error=error, attributes=_session_attributes(session))
    except Exception as exc:
        report_failure("mcp tool span", exc)


def _recorded(original: Any) -> Any:
    @functools.wraps(original)
    async def call_tool(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = current_rollout()
        if state is None or state.framework_tools > 0:  # outside a rollout, or a framework records it
            return await original(self, *args, **kwargs)
        name, arguments = _call(args, kwargs)
        start_ns = time.time_ns()
        try:
            result = await original(self, *args, **kwargs)
        except BaseException as exc:
            _record(self, name, arguments, start_ns, raised=exc)
            raise
        _record(self, name, arguments, start_ns, result=result)
        return result

    return call_tool


def instrument() -> bool:
    """Wrap ``ClientSession.call_tool`` (once per process)."""
    global _not_done
    try:
        from mcp import types
        from mcp.client.session import ClientSession
    except ImportError:
        return False
    _not_done = tuple(t for t in (getattr(types, "InputRequiredResult", None),) if isinstance(t, type))
    _replace(ClientSession, "call_tool", _recorded)
    return True


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
