"""What a rollout of ``@trace`` (``decorator.py``) starts from: the fields a runner sets for the next rollouts in
this context (``rollout_overrides``), and the task recorded from the call's arguments (``_task_of``), made JSON
and storable without ever failing the call (a stand-in for what JSON cannot hold, logged once and counted)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import orjson

from ..boundaries import MAX_JSON_DEPTH, check_int, json_problem, safe_text, storable
from ..diagnostics import count, report_failure
from ..errors import ConfigurationError
from ..records import SAMPLING_KEYS

_overrides: ContextVar[dict[str, Any] | None] = ContextVar("lightning_rl_overrides", default=None)
_OVERRIDE_KEYS = frozenset({"rollout_id", "group_id", "attempt", "mode", "task", "timeout", "endpoint", "sampling"})
#: Sampling fields a trainer may impose on every LLM request of a rollout (``sampling=``).


@contextlib.contextmanager
def rollout_overrides(**values: Any) -> Iterator[None]:
    """Set fields of the next rollout(s) started in this context: ``rollout_id``, ``group_id``,
    ``attempt``, ``mode``, ``task``, ``timeout`` (seconds; async agents: the rollout ends
    ``timed_out`` when it is exceeded) and ``endpoint`` (``(base_url, model)`` the agent should
    call, read with ``current_endpoint()``; set by trainers that choose the server, e.g. verl) and
    ``sampling`` (a dict of ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``
    that every OpenAI request of the rollout is sent with, whatever the agent asked: the trainer
    computes log-probs at the temperature it set, so the agent must sample at it too).
    Runners use it; users can use it to choose a rollout id."""
    unknown = set(values) - _OVERRIDE_KEYS
    if unknown:
        raise ConfigurationError(
            f"unknown rollout override(s) {sorted(unknown)}; known: {sorted(_OVERRIDE_KEYS)}"
        )
    sampling = values.get("sampling")
    if sampling is not None and (not isinstance(sampling, dict) or set(sampling) - SAMPLING_KEYS):
        raise ConfigurationError(f"sampling must be a dict with keys among {sorted(SAMPLING_KEYS)}, got {sampling!r}")
    check_int(values.get("attempt"), "attempt", optional=True)
    for key in ("rollout_id", "group_id"):
        if values.get(key) is not None and (not isinstance(values[key], str) or not values[key]):
            raise ConfigurationError(f"{key} must be a non-empty string, got {safe_text(values[key])}")
    token = _overrides.set({**(_overrides.get() or {}), **values})
    try:
        yield
    finally:
        _overrides.reset(token)


def _stand_in(value: Any) -> str:
    """What a task records for a value JSON cannot hold: its type, stable from call to call (no id or
    address), so that tries of the same task still share a group."""
    cls = type(value)
    return f"<{cls.__module__}.{cls.__qualname__}>"


def _json_default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)  # pydantic models
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(type(value).__name__)


def _json_safe(value: Any, replaced: list[str], depth: int = 0) -> Any:
    """``value`` with everything JSON cannot hold replaced by a stand-in (listed in ``replaced``); the
    walk stops at ``MAX_JSON_DEPTH`` (the caller records a task nested deeper in its safe form)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if depth > MAX_JSON_DEPTH:
        return None
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else _stand_in(k):
                _json_safe(v, replaced, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, replaced, depth + 1) for v in value]
    try:
        return orjson.loads(orjson.dumps(value, default=_json_default))
    except TypeError:
        replaced.append(_stand_in(value))
        return _stand_in(value)


@dataclass(slots=True)
class _Options:
    name: str
    agent: str | None
    mode: str | None
    new_rollout: bool
    task_fn: Callable[..., Any] | None
    task_names: tuple[str, ...] | None
    signature: inspect.Signature | None


_JSON_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def _arguments(opts: _Options, args: tuple, kwargs: dict, *, defaults: bool = False) -> dict[str, Any] | None:
    try:
        bound = opts.signature.bind(*args, **kwargs) if opts.signature else None
    except TypeError:
        return None  # the call itself is wrong; the function will raise its own TypeError
    if bound is None:
        return None
    if defaults:
        bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k not in ("self", "cls")}


def _task_value(opts: _Options, args: tuple, kwargs: dict) -> Any:
    overrides = _overrides.get()
    if overrides and "task" in overrides:
        return overrides["task"]
    if opts.task_fn is not None:
        try:
            return opts.task_fn(*args, **kwargs)
        except Exception as exc:  # the user's task function must not fail their agent either
            report_failure(f"task function of {opts.name}", exc)
    arguments = _arguments(opts, args, kwargs, defaults=opts.task_names is not None)
    if arguments is None:
        return {"args": list(args), "kwargs": kwargs}
    if opts.task_names is not None:
        if len(opts.task_names) == 1:
            return arguments.get(opts.task_names[0])
        return {name: arguments.get(name) for name in opts.task_names}
    return next(iter(arguments.values())) if len(arguments) == 1 else arguments


def _task_of(opts: _Options, args: tuple, kwargs: dict) -> tuple[Any, bytes]:
    """The task as stored and its JSON text. Never raises: a value JSON cannot hold becomes a stand-in,
    an integer beyond 64 bits its decimal text, a task nested deeper than ``MAX_JSON_DEPTH`` the
    (truncated) text of its repr; each logged once and counted."""
    value = _task_value(opts, args, kwargs)
    try:
        text = orjson.dumps(value, default=_json_default, option=_JSON_OPTIONS)
    except TypeError:  # objects JSON cannot hold, or nesting / integers orjson cannot write
        replaced: list[str] = []
        value = _json_safe(value, replaced)
        if replaced:
            count("task_values_not_json")
            report_failure(f"task of {opts.name} not JSON", message=(
                f"lightning-rl: traced function {opts.name!r} got arguments JSON cannot store ({', '.join(sorted(set(replaced)))}); "
                "its task records them as '<module.Class>'. Name the task with @trace(task=\"question\") (a parameter "
                "name or a list of them) or @trace(task=lambda *args, **kwargs: ...)"))
        try:
            text = orjson.dumps(value, option=_JSON_OPTIONS)
        except TypeError:
            text = b""  # nested or numbered beyond what can be stored: made storable below
    task = orjson.loads(text) if text else value
    problem = json_problem(task, "task")
    if problem is None:
        return task, text
    task = safe_text(task) if "nested deeper" in problem else storable(task)
    count("task_values_made_storable")
    report_failure(f"task of {opts.name} not storable", message=(
        f"lightning-rl: the task of traced function {opts.name!r} cannot be stored as it is ({problem}); it is "
        "recorded in a safe form (integers beyond 64 bits as text, a task nested too deep as its truncated repr). "
        "Name the task with @trace(task=\"question\") or @trace(task=lambda *args, **kwargs: ...) (logged once)"))
    return task, orjson.dumps(task, option=_JSON_OPTIONS)
