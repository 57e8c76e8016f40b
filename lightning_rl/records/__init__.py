"""Persisted and wire records (pydantic v2). See DESIGN.md, "Records".

Every record forbids unknown fields and carries ``schema_version`` so that readers can tell a
record from a newer writer. Hot-path internals use plain dataclasses instead (``SpanRow``: a finished
span on its way from the tracer to a store, shared by both layers).

In five parts, every name importable from here (``from lightning_rl.records import Rollout``):

* ``rollouts.py``: the record base, a rollout's lifecycle (``RolloutStatus``, ``TRANSITIONS``), ``Rollout``,
  ``Reward``, ``QuarantinedRecord``, the rollout page (``RolloutQuery``, ``RolloutPage``);
* ``spans.py``: ``Span`` and its ``SpanTokens``; the hot path's ``SpanRow`` and ``PackedTokens`` (``pack_ids``, ...);
* ``policies.py``: publishes and decisions (``PolicyRecord``, ``Decision``, ``PolicyDecision``);
* ``queue.py``: the task queue's ``QueueEntry`` and ``QueueStatus``;
* ``trajectories.py``: what a trainer reads (``LLMCall``, ``Trajectory``, ``Sample``).
"""

from .policies import Decision, PolicyDecision, PolicyRecord
from .queue import QUEUE_OVERRIDE_KEYS, SAMPLING_KEYS, QueueEntry, QueueStatus
from .rollouts import (
    ROLLOUT_SORTS, SCHEMA_VERSION, TRANSITIONS, Mode, QuarantinedRecord, Reward, RewardSource, Rollout, RolloutPage,
    RolloutQuery, RolloutRow, RolloutStatus, _Record, allowed_from, check_transition,
)
from .spans import PackedTokens, Span, SpanRow, SpanTokens, pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from .trajectories import LLMCall, Sample, TokenIdsSource, ToolCall, Trajectory

__all__ = [
    "Decision", "LLMCall", "Mode", "PackedTokens", "PolicyDecision", "PolicyRecord", "QUEUE_OVERRIDE_KEYS",
    "QuarantinedRecord", "QueueEntry", "QueueStatus", "ROLLOUT_SORTS", "Reward", "RewardSource", "Rollout",
    "RolloutPage", "RolloutQuery", "RolloutRow", "RolloutStatus", "SAMPLING_KEYS", "SCHEMA_VERSION", "Sample",
    "Span", "SpanRow", "SpanTokens", "TRANSITIONS", "TokenIdsSource", "ToolCall", "Trajectory", "allowed_from",
    "check_transition", "pack_ids", "pack_logprobs", "unpack_ids", "unpack_logprobs",
]
