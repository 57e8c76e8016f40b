"""``emit_reward``: a reward recorded from anywhere inside a traced call.

Which LLM call an emitted reward belongs to (the rule assembly and credit assignment use): the
latest LLM call of this rollout that had *finished* when the reward was emitted (of ``agent``'s
calls, when ``agent`` is given), unless ``llm_call_index`` says otherwise. A reward emitted before
any LLM call finished has no call; assembly gives it to the first call.
"""

from __future__ import annotations

from opentelemetry import trace as otel_trace

from .. import semconv
from ..diagnostics import report_failure
from ..boundaries import check_int
from ..errors import check_reward
from ..records import Reward, RewardSource
from .context import require_rollout
from .provider import tracing


def emit_reward(
    value: float,
    name: str = "reward",
    *,
    agent: str | None = None,
    llm_call_index: int | None = None,
) -> None:
    """Record a reward for the active rollout. Raises ``InvalidRewardError`` (a ValueError) for a
    non-finite or non-numeric value and ``NotInRolloutError`` outside any traced call."""
    value = check_reward(value, what=f"reward {name!r}")
    check_int(llm_call_index, "llm_call_index", optional=True, meaning="the index of an LLM call of this rollout")
    state = require_rollout("emit_reward()")
    if llm_call_index is None:
        llm_call_index = state.last_llm_call_by_agent.get(agent) if agent else state.last_llm_call
    reward = Reward(
        rollout_id=state.rollout_id,
        value=value,
        name=name,
        llm_call_index=llm_call_index,
        agent=agent,
        source=RewardSource.EMITTED,
    )
    try:
        tracing.sink().write_reward(reward)
    except Exception as exc:
        report_failure("reward write", exc)
    try:
        span = otel_trace.get_current_span()
        if span.is_recording():
            span.add_event(
                semconv.GEN_AI_EVALUATION_RESULT,
                {semconv.GEN_AI_EVALUATION_NAME: name, semconv.GEN_AI_EVALUATION_SCORE_VALUE: value},
            )
    except Exception as exc:
        report_failure("reward event", exc)
