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

The overrides a runner sets and the task recorded from the call's arguments: ``tasks.py``.
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
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Status, StatusCode

from .. import semconv
from ..diagnostics import report_failure
from ..errors import ConfigurationError, InvalidRewardError, check_reward
from ..records import Mode, Reward, RewardSource, Rollout, RolloutStatus
from ..settings import check_mode
from .context import RolloutState, _agent, _llm_hint, _our_span, _rollout
from .provider import agent_span, parent_context, tracing
from .redaction import redact_rollout, redact_text
from .tasks import _Options, _overrides, _task_of, rollout_overrides

#: ``rollout_overrides`` (``tasks.py``) is imported from here too.


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
