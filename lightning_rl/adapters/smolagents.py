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

import functools
import inspect
from collections.abc import Iterator
from typing import Any

from ..diagnostics import report_failure
from ..tracer.context import agent_scope, current_rollout, tool_span

_installed = False


def _name_of(agent: Any) -> str | None:
    name = getattr(agent, "name", None)
    return name if isinstance(name, str) and name else None


def _named_steps(steps: Iterator[Any], name: str) -> Iterator[Any]:
    with agent_scope(name):
        yield from steps


def _wrap_run(run: Any) -> Any:
    @functools.wraps(run)
    def traced_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = _name_of(self) if current_rollout() is not None else None
        if name is None:
            return run(self, *args, **kwargs)
        with agent_scope(name):
            result = run(self, *args, **kwargs)
        return _named_steps(result, name) if inspect.isgenerator(result) else result

    traced_run.__lightning_rl__ = True  # type: ignore[attr-defined]
    return traced_run


def _arguments(tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tool's arguments as the model sent them (a dict of its inputs), where they can be told."""
    if not args:
        return kwargs
    if len(args) == 1 and not kwargs and isinstance(args[0], dict):
        return args[0]
    names = list(getattr(tool, "inputs", None) or {})
    return {**dict(zip(names, args)), **kwargs} if len(names) >= len(args) else {"args": list(args), **kwargs}


def _wrap_call(call: Any) -> Any:
    @functools.wraps(call)
    def traced_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if current_rollout() is None:
            return call(self, *args, **kwargs)
        try:
            name = str(getattr(self, "name", None) or type(self).__name__)
            public = {k: v for k, v in kwargs.items() if k != "sanitize_inputs_outputs"}
            span = tool_span(name, arguments=_arguments(self, args, public))
            handle = span.__enter__()
        except Exception as exc:  # tracing never raises into the agent: the tool runs unrecorded
            report_failure("smolagents tool span", exc)
            return call(self, *args, **kwargs)
        try:
            result = call(self, *args, **kwargs)
        except BaseException as exc:  # recorded on the span, and raised to the agent as it was
            span.__exit__(type(exc), exc, exc.__traceback__)
            raise
        handle.result = result if isinstance(result, (str, int, float, bool, list, dict)) or result is None \
            else repr(result)
        span.__exit__(None, None, None)
        return result

    traced_call.__lightning_rl__ = True  # type: ignore[attr-defined]
    return traced_call


def instrument() -> bool:
    """Wrap ``MultiStepAgent.run`` and ``Tool.__call__`` (once per process; idempotent)."""
    global _installed
    try:
        from smolagents.agents import MultiStepAgent
        from smolagents.tools import Tool
    except ImportError:
        return False
    if _installed:
        return True
    _installed = True
    if not getattr(MultiStepAgent.run, "__lightning_rl__", False):
        MultiStepAgent.run = _wrap_run(MultiStepAgent.run)  # type: ignore[method-assign]
    if not getattr(Tool.__call__, "__lightning_rl__", False):
        Tool.__call__ = _wrap_call(Tool.__call__)  # type: ignore[method-assign]
    return True
