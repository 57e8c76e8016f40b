"""Rollout context, the ``@trace`` decorator, ``emit_reward`` and the private OTel provider."""

from .context import RolloutState, ToolSpan, agent_scope, current_agent_name, current_rollout, tool_span
from .decorator import current_endpoint, current_rollout_id, rollout_overrides, trace
from .provider import Tracing, tracing
from .rewards import emit_reward
from ..records import SpanRow
from ..sink import SpanSink

__all__ = [
    "RolloutState",
    "SpanRow",
    "SpanSink",
    "ToolSpan",
    "Tracing",
    "agent_scope",
    "current_agent_name",
    "current_endpoint",
    "current_rollout",
    "current_rollout_id",
    "emit_reward",
    "rollout_overrides",
    "tool_span",
    "trace",
    "tracing",
]
