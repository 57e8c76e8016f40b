"""Spans and rewards of one rollout into a Trajectory: LLM calls in per-rollout order, credited rewards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from .. import semconv
from ..diagnostics import count, report_failure
from ..records import LLMCall, Reward, Rollout, Span, TokenIdsSource, ToolCall, Trajectory
from .credit import assign_credit


def _malformed(what: str) -> None:
    count("malformed_span_fields")
    report_failure("malformed span field", message=(
        f"lightning-rl: a stored span has a field the assembly cannot read ({what}); it is read without it and "
        "counted (malformed_span_fields). It came from a client or version that did not check it (logged once)"))


def _typed(attributes: Any, key: str, types: tuple[type, ...], default: Any = None) -> Any:
    """An attribute of the type the assembly reads it as; another type is dropped and counted."""
    value = attributes.get(key)
    if value is None:
        return default
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return value
    _malformed(f"{key} is {type(value).__name__}")
    return default


def _json(value: Any, default: Any, key: str) -> Any:
    """JSON text of the shape of ``default`` (a list or a dict); anything else is ``default``, counted."""
    if value is None:
        return default
    parsed = value
    if isinstance(value, str):
        try:
            parsed = orjson.loads(value)
        except orjson.JSONDecodeError:
            parsed = None
    if isinstance(parsed, type(default)):
        return parsed
    _malformed(f"{key} is not a JSON {type(default).__name__}")
    return default


def _messages(value: Any, key: str) -> list[dict[str, Any]]:
    """A list of message objects; entries that are not objects are left out (counted)."""
    messages = _json(value, [], key)
    kept = [m for m in messages if isinstance(m, dict)]
    if len(kept) != len(messages):
        _malformed(f"{key} holds {len(messages) - len(kept)} entries that are not message objects")
    return kept


def _tool_calls(messages: list[dict[str, Any]]) -> list[ToolCall]:
    calls = []
    for message in messages:
        listed = message.get("tool_calls") or []
        if not isinstance(listed, list):
            _malformed("tool_calls is not a list")
            continue
        for tc in listed:
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict):
                _malformed("a tool call without a function object")
                continue
            args = fn.get("arguments", "")
            name, call_id = fn.get("name"), tc.get("id")
            calls.append(ToolCall(id=call_id if isinstance(call_id, str) else None,
                                  name=name if isinstance(name, str) else "",
                                  arguments=args if isinstance(args, str) else orjson.dumps(args, default=str).decode()))
    return calls


def llm_call_from_span(span: Span) -> LLMCall:
    """The LLM call a span records. Fields of the wrong type (a client that did not check them, a file
    of another version) are read as absent and counted (``malformed_span_fields``), never raised."""
    a = span.attributes
    output = _messages(a.get(semconv.GEN_AI_OUTPUT_MESSAGES), semconv.GEN_AI_OUTPUT_MESSAGES)
    finish = _typed(a, semconv.GEN_AI_RESPONSE_FINISH_REASONS, (list, tuple), ())
    tokens = span.tokens
    if tokens is not None:
        prompt, response, logprobs = tokens.prompt_ids, tokens.response_ids, tokens.response_logprobs
    else:  # arrays a store could not pack when it was migrated stay attributes
        prompt = _typed(a, semconv.PROMPT_TOKEN_IDS, (list, tuple), [])
        response = _typed(a, semconv.RESPONSE_TOKEN_IDS, (list, tuple), [])
        logprobs = _typed(a, semconv.RESPONSE_LOGPROBS, (list, tuple))
    source = _typed(a, semconv.TOKEN_IDS_SOURCE, (str,), semconv.SOURCE_MISSING)
    if source not in _SOURCES:
        _malformed(f"{semconv.TOKEN_IDS_SOURCE} is {source[:40]!r}")
        source = semconv.SOURCE_MISSING
    if source == semconv.SOURCE_ENGINE and tokens is None and not prompt:
        source = semconv.SOURCE_MISSING  # recorded, but its prompt could not be read back
    call = LLMCall(
        index=_typed(a, semconv.LLM_CALL_INDEX, (int,), span.seq),
        span_id=span.span_id,
        parent_id=span.parent_id,
        operation=_typed(a, semconv.GEN_AI_OPERATION_NAME, (str,), semconv.OP_CHAT),
        model=_typed(a, semconv.GEN_AI_REQUEST_MODEL, (str,)),
        agent_name=_typed(a, semconv.GEN_AI_AGENT_NAME, (str,)),
        input_messages=_messages(a.get(semconv.GEN_AI_INPUT_MESSAGES), semconv.GEN_AI_INPUT_MESSAGES),
        output_messages=output,
        tool_calls=_tool_calls(output),
        token_ids_source=TokenIdsSource(source),
        policy_version=_typed(a, semconv.POLICY_VERSION, (int,)),
        policy_version_end=_typed(a, semconv.POLICY_VERSION_END, (int,)),
        sampling_params=_json(a.get(semconv.SAMPLING_PARAMS), {}, semconv.SAMPLING_PARAMS),
        finish_reason=(finish[0] if finish and isinstance(finish[0], str) else None),
        streamed=bool(a.get(semconv.STREAMED, False)),
        incomplete=bool(a.get(semconv.INCOMPLETE, False)),
        start_ns=span.start_ns,
        end_ns=span.end_ns,
    )
    # The arrays were unpacked from the store's own int32/float columns: set, not validated element by element.
    call.prompt_token_ids, call.response_token_ids = list(prompt), list(response)
    call.response_logprobs = list(logprobs) if logprobs is not None else None
    return call


_SOURCES = frozenset({semconv.SOURCE_ENGINE, semconv.SOURCE_RETOKENIZED, semconv.SOURCE_MISSING})


def _skipped(rollout_id: str, seq: int, why: str) -> None:
    count("malformed_spans_skipped")
    report_failure("malformed span skipped", message=(
        f"lightning-rl: span {seq} of rollout {rollout_id!r} cannot be read as an LLM or tool call ({why[:200]}); "
        "the trajectory is assembled without it and it is counted (malformed_spans_skipped; logged once)"))


def assemble(
    rollout: Rollout,
    spans: Sequence[Span],
    rewards: Sequence[Reward],
    *,
    credit: str = "final",
    reward_name: str = "reward",
    **credit_kwargs: Any,
) -> Trajectory:
    calls: list[LLMCall] = []
    tools: list[Span] = []
    for span in sorted(spans, key=lambda s: s.seq):  # per-rollout sequence, never the clock
        op = span.attributes.get(semconv.GEN_AI_OPERATION_NAME)
        if not isinstance(op, str):
            if op is not None:
                _skipped(rollout.rollout_id, span.seq, f"{semconv.GEN_AI_OPERATION_NAME} is {type(op).__name__}")
            continue
        if op in semconv.LLM_OPERATIONS:
            try:
                calls.append(llm_call_from_span(span))
            except Exception as exc:  # one span must never stop the reading of every rollout
                _skipped(rollout.rollout_id, span.seq, f"{type(exc).__name__}: {exc}")
        elif op == semconv.OP_EXECUTE_TOOL:
            tools.append(span)
    calls.sort(key=lambda c: c.index)
    final, credited = assign_credit(
        [c.agent_name for c in calls], rewards, credit=credit, reward_name=reward_name, **credit_kwargs
    )
    for call, value in zip(calls, credited):
        call.reward = value
    agents: list[str] = []
    for name in [rollout.agent, *(c.agent_name for c in calls)]:
        if name and name not in agents:
            agents.append(name)
    return Trajectory(
        rollout_id=rollout.rollout_id,
        name=rollout.name,
        task=rollout.task,
        group_id=rollout.group_id,
        attempt=rollout.attempt,
        mode=rollout.mode,
        status=rollout.status,
        policy_version=rollout.policy_version,
        start_time=rollout.start_time,
        end_time=rollout.end_time,
        error=rollout.error,
        llm_calls=calls,
        rewards=list(rewards),
        final_reward=final,
        credit=credit,
        agents=agents,
        tool_spans=tools,
        missing_token_ids=sum(1 for c in calls if c.token_ids_source == TokenIdsSource.MISSING),
    )
