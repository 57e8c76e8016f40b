"""``@trace``: each call of the decorated function becomes a rollout (sync and async).

Rules users can rely on:

* The task recorded for a rollout is the call's arguments as JSON: the single argument itself when
  there is one (``self``/``cls`` skipped), else a dict by parameter name. ``task="question"`` (a
  parameter name, or a list of names) or ``task=lambda *args, **kwargs: ...`` chooses it. A value JSON
  cannot hold (a client, a connection) is recorded as ``"<module.Class>"``, logged once and counted
  (``task_values_not_json``): decorating existing code never fails the call.
* A traced call inside another traced call is a child ``invoke_agent`` span of the same rollout
  (its return value is not a reward) unless ``new_rollout=True``.
* A returned int or float (not bool) is recorded as the final reward (name ``reward``, source
  ``returned``). A returned NaN/inf marks the rollout failed and raises :class:`InvalidRewardError`.
* An exception marks the rollout ``failed`` (``timed_out`` for ``TimeoutError``) with the error
  text, and is re-raised unchanged.
* The rollout's rows are on disk before the decorated call returns (the sink is flushed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Status, StatusCode

from .. import semconv
from ..boundaries import MAX_JSON_DEPTH, check_int, json_problem, safe_text, storable
from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, InvalidRewardError, check_reward
from ..records import SAMPLING_KEYS, Mode, Reward, RewardSource, Rollout, RolloutStatus
from ..settings import check_mode
from .context import RolloutState, _agent, _llm_hint, _our_span, _rollout
from .provider import agent_span, parent_context, tracing
from .redaction import redact_rollout, redact_text

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


class _Active:
    """One running rollout: what must be undone and recorded when it ends."""

    __slots__ = ("state", "rollout", "span", "tokens", "sink")

    def __init__(self, state: RolloutState, rollout: Rollout, span: Any, tokens: tuple, sink: Any) -> None:
        self.state, self.rollout, self.span, self.tokens, self.sink = state, rollout, span, tokens, sink


def _begin(opts: _Options, args: tuple, kwargs: dict) -> _Active:
    task, task_json = _task_of(opts, args, kwargs)
    overrides = _overrides.get() or {}
    mode = check_mode(overrides.get("mode") or opts.mode or tracing.settings.mode)
    agent = opts.agent or opts.name
    rollout = Rollout(
        rollout_id=overrides.get("rollout_id") or uuid.uuid4().hex,
        name=opts.name,
        agent=agent,
        task=task,
        group_id=overrides.get("group_id") or hashlib.sha1(task_json).hexdigest()[:16],
        attempt=overrides.get("attempt", 0),
        mode=Mode(mode),
        status=RolloutStatus.RUNNING,
    )
    sink = tracing.sink()  # a store that cannot open is a set-up error: it surfaces here
    redact = tracing.redaction(check=True)  # so does a LIGHTNING_RL_REDACT that names no function
    # A provisional version: the rollout's own is the oldest of its LLM calls', set when it ends.
    rollout.policy_version = tracing.policy_version()
    try:
        sink.start_rollout(rollout if redact is None else redact_rollout(rollout, redact))
    except Exception as exc:
        report_failure("rollout start", exc)
    state = RolloutState(rollout.rollout_id, opts.name, agent, mode, rollout.policy_version,
                         group_id=rollout.group_id, attempt=rollout.attempt, sampling=overrides.get("sampling"))
    rollout_token = _rollout.set(state)
    agent_token = _agent.set(None)
    hint_token = _llm_hint.set(None)
    span = None
    ctx_token = None
    span_token = None
    try:
        span = tracing.tracer.start_span(
            f"invoke_agent {agent}",
            context=parent_context(),
            attributes={
                semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                semconv.GEN_AI_AGENT_NAME: agent,
                semconv.ROLLOUT_ID: rollout.rollout_id,
                semconv.POLICY_VERSION: rollout.policy_version,
            },
        )
        ctx_token = otel_context.attach(otel_trace.set_span_in_context(span))
        span_token = _our_span.set(span)
    except Exception as exc:
        report_failure("rollout span", exc)
    return _Active(state, rollout, span, (rollout_token, agent_token, ctx_token, hint_token, span_token), sink)


def _is_reward(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _end(active: _Active, result: Any = None, exc: BaseException | None = None) -> InvalidRewardError | None:
    """Record the end of a rollout. Returns the reward error to raise, if the returned reward was bad."""
    state, rollout, span = active.state, active.rollout, active.span
    status, error, reward_error = RolloutStatus.SUCCEEDED, None, None
    kind = ""  # the exception's type: a name, kept whole when the message is redacted
    if exc is not None:
        status = RolloutStatus.TIMED_OUT if isinstance(exc, TimeoutError) else RolloutStatus.FAILED
        kind = f"{type(exc).__name__}: "
        error = f"{kind}{exc}"
    elif _is_reward(result):
        try:
            value = check_reward(result, what=f"the reward returned by {rollout.name!r}")
            active.sink.write_reward(
                Reward(rollout_id=rollout.rollout_id, value=value, source=RewardSource.RETURNED)
            )
            # a reward helper's score (lightning_rl.rewards): its parts too, each under its own name
            for part, part_value in (getattr(result, "reward_parts", None) or {}).items():
                if part != "reward":
                    active.sink.write_reward(Reward(rollout_id=rollout.rollout_id, value=check_reward(
                        part_value, what=f"reward part {part!r}"), name=part, source=RewardSource.RETURNED))
        except InvalidRewardError as bad:
            status, error, reward_error = RolloutStatus.FAILED, str(bad), bad
        except Exception as failure:
            report_failure("reward write", failure)
    try:
        for call in list(state.open_calls.values()):  # streams the agent never finished reading
            call.finish(incomplete=True)
    except Exception as failure:
        report_failure("closing open LLM calls", failure)
    rollout_token, agent_token, ctx_token, hint_token, span_token = active.tokens
    if span is not None:
        try:
            if exc is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, error))
            elif error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()
        except Exception as failure:
            report_failure("rollout span end", failure)
    if span_token is not None:
        _our_span.reset(span_token)
    if ctx_token is not None:
        otel_context.detach(ctx_token)
    _llm_hint.reset(hint_token)
    _agent.reset(agent_token)
    _rollout.reset(rollout_token)
    state.note_end()
    try:
        redact = tracing.redaction()
        if redact is not None and error is not None:
            error = kind + (redact_text(error[len(kind):], redact) or "")
        active.sink.finish_rollout(rollout.rollout_id, status, time.time(), error, state.oldest_call_version)
    except Exception as failure:
        report_failure("rollout finish", failure)
    return reward_error


def _flush(sink: Any) -> None:
    try:
        if not sink.flush(tracing.settings.flush_timeout):
            report_failure(
                "flush timeout",
                message="lightning-rl: the store did not confirm a finished rollout within "
                f"{tracing.settings.flush_timeout}s; its rows are still queued, not dropped "
                "(raise LIGHTNING_RL_FLUSH_TIMEOUT or check the store)",
            )
    except Exception as failure:
        report_failure("flush", failure)


def trace(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    agent: str | None = None,
    mode: str | None = None,
    new_rollout: bool = False,
    task: Callable[..., Any] | str | Sequence[str] | None = None,
) -> Any:
    """Make every call of ``fn`` a rollout. Use as ``@trace`` or ``@trace(name=..., agent=...)``.

    ``task``: what the rollout records as its task: a parameter name (``"question"``), a list of
    names, or a function of the call's arguments. Default: the arguments themselves."""
    if mode is not None:
        check_mode(mode)
    task_names = (task,) if isinstance(task, str) else tuple(task) if task is not None and not callable(task) else None
    task_fn = task if callable(task) else None

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            signature = None
        if task_names is not None and signature is not None:
            unknown = [n for n in task_names if n not in signature.parameters]
            if unknown:
                raise ConfigurationError(
                    f"@trace(task={task!r}) names {unknown} but {func.__name__} takes {list(signature.parameters)}; "
                    "give parameter names of the traced function")
        opts = _Options(name or func.__name__, agent, mode, new_rollout, task_fn, task_names, signature)

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                if _rollout.get() is not None and not opts.new_rollout:
                    with _nested(opts):
                        return await func(*args, **kwargs)
                active = _begin(opts, args, kwargs)
                timeout = (_overrides.get() or {}).get("timeout")
                try:
                    if timeout is None:
                        result = await func(*args, **kwargs)
                    else:
                        result = await asyncio.wait_for(func(*args, **kwargs), timeout)
                except BaseException as exc:
                    _end(active, exc=exc)
                    await asyncio.get_running_loop().run_in_executor(None, _flush, active.sink)
                    raise
                reward_error = _end(active, result=result)
                await asyncio.get_running_loop().run_in_executor(None, _flush, active.sink)
                if reward_error is not None:
                    raise reward_error
                return result

            return async_wrapper

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            if _rollout.get() is not None and not opts.new_rollout:
                with _nested(opts):
                    return func(*args, **kwargs)
            active = _begin(opts, args, kwargs)
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:
                _end(active, exc=exc)
                _flush(active.sink)
                raise
            reward_error = _end(active, result=result)
            _flush(active.sink)
            if reward_error is not None:
                raise reward_error
            return result

        return sync_wrapper

    if fn is not None:
        return decorate(fn)
    return decorate


@contextlib.contextmanager
def _nested(opts: _Options) -> Iterator[None]:
    token = _agent.set(opts.agent) if opts.agent else None
    try:
        with agent_span(opts.agent or opts.name):
            yield
    finally:
        if token is not None:
            _agent.reset(token)


def current_endpoint() -> tuple[str, str] | None:
    """``(base_url, model)`` that the runner or trainer chose for this rollout (verl picks its own
    vLLM server per request), or None: then the agent calls what it was configured with."""
    overrides = _overrides.get()
    endpoint = overrides.get("endpoint") if overrides else None
    return tuple(endpoint) if endpoint else None


def current_rollout_id() -> str | None:
    """The id of the active rollout, or None outside any traced call."""
    state = _rollout.get()
    return state.rollout_id if state is not None else None
