"""Spans and rewards of one rollout into a Trajectory: LLM calls in per-rollout order, credited rewards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from .. import semconv
from ..records import LLMCall, Reward, Rollout, Span, TokenIdsSource, ToolCall, Trajectory
from .credit import assign_credit


def _json(value: Any, default: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return default
    return default if value is None else value


def _tool_calls(messages: list[dict[str, Any]]) -> list[ToolCall]:
    calls = []
    for message in messages:
        for tc in message.get("tool_calls") or []:
            fn = tc.get("function") or {}
            args = fn.get("arguments", "")
            calls.append(
                ToolCall(id=tc.get("id"), name=fn.get("name") or "", arguments=args if isinstance(args, str) else orjson.dumps(args).decode())
            )
    return calls


def llm_call_from_span(span: Span) -> LLMCall:
    a = span.attributes
    output = _json(a.get(semconv.GEN_AI_OUTPUT_MESSAGES), [])
    finish = a.get(semconv.GEN_AI_RESPONSE_FINISH_REASONS)
    tokens = span.tokens
    if tokens is not None:
        prompt, response, logprobs = tokens.prompt_ids, tokens.response_ids, tokens.response_logprobs
    else:  # arrays a store could not pack when it was migrated stay attributes
        prompt, response = a.get(semconv.PROMPT_TOKEN_IDS) or [], a.get(semconv.RESPONSE_TOKEN_IDS) or []
        logprobs = a.get(semconv.RESPONSE_LOGPROBS)
    source = a.get(semconv.TOKEN_IDS_SOURCE, semconv.SOURCE_MISSING)
    if source == semconv.SOURCE_ENGINE and tokens is None and not prompt:
        source = semconv.SOURCE_MISSING  # recorded, but its prompt could not be read back
    call = LLMCall(
        index=a.get(semconv.LLM_CALL_INDEX, span.seq),
        span_id=span.span_id,
        parent_id=span.parent_id,
        operation=a.get(semconv.GEN_AI_OPERATION_NAME, semconv.OP_CHAT),
        model=a.get(semconv.GEN_AI_REQUEST_MODEL),
        agent_name=a.get(semconv.GEN_AI_AGENT_NAME),
        input_messages=_json(a.get(semconv.GEN_AI_INPUT_MESSAGES), []),
        output_messages=output,
        tool_calls=_tool_calls(output),
        token_ids_source=TokenIdsSource(source),
        policy_version=a.get(semconv.POLICY_VERSION),
        policy_version_end=a.get(semconv.POLICY_VERSION_END),
        sampling_params=_json(a.get(semconv.SAMPLING_PARAMS), {}),
        finish_reason=(finish[0] if finish else None),
        streamed=bool(a.get(semconv.STREAMED, False)),
        incomplete=bool(a.get(semconv.INCOMPLETE, False)),
        start_ns=span.start_ns,
        end_ns=span.end_ns,
    )
    # The arrays were unpacked from the store's own int32/float columns: set, not validated element by element.
    call.prompt_token_ids, call.response_token_ids = list(prompt), list(response)
    call.response_logprobs = list(logprobs) if logprobs is not None else None
    return call


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
        if op in semconv.LLM_OPERATIONS:
            calls.append(llm_call_from_span(span))
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
