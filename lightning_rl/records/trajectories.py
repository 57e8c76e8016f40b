"""What the trainer reads, assembled from a store's records and never stored: a rollout's LLM calls in order
(``LLMCall``, with its ``ToolCall``s and where its token ids came from, ``TokenIdsSource``), the
``Trajectory`` with its rewards after credit assignment, and the ``Sample`` a trainer consumes."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .rollouts import Mode, Reward, RolloutStatus, _Record
from .spans import Span

class TokenIdsSource(StrEnum):
    ENGINE = "engine"
    RETOKENIZED = "retokenized"
    MISSING = "missing"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    name: str
    arguments: str = ""


class LLMCall(_Record):
    """One LLM request/response inside a rollout, derived from its span."""

    index: int
    span_id: str
    parent_id: str | None = None
    operation: str = "chat"
    model: str | None = None
    agent_name: str | None = None
    input_messages: list[dict[str, Any]] = Field(default_factory=list)
    output_messages: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[ToolCall] = Field(default_factory=list)
    prompt_token_ids: list[int] = Field(default_factory=list)
    response_token_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] | None = None
    token_ids_source: TokenIdsSource = TokenIdsSource.MISSING
    policy_version: int | None = None
    #: The version live when the call ended, only when a publish landed while it ran (else None).
    policy_version_end: int | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    finish_reason: str | None = None
    streamed: bool = False
    incomplete: bool = False
    start_ns: int = 0
    end_ns: int = 0
    reward: float | None = None  # after credit assignment

    @property
    def response_text(self) -> str:
        parts = [m.get("content") or "" for m in self.output_messages]
        return "".join(p if isinstance(p, str) else "" for p in parts)


class Trajectory(_Record):
    """A rollout with its LLM calls in order and rewards after credit assignment (assembled, not stored)."""

    rollout_id: str
    name: str = ""
    task: Any = None
    group_id: str | None = None
    attempt: int = 0
    mode: Mode = Mode.TRAIN
    status: RolloutStatus
    policy_version: int | None = None
    start_time: float
    end_time: float | None = None
    error: str | None = None
    llm_calls: list[LLMCall] = Field(default_factory=list)
    rewards: list[Reward] = Field(default_factory=list)
    final_reward: float | None = None
    credit: str = "final"
    agents: list[str] = Field(default_factory=list)
    tool_spans: list[Span] = Field(default_factory=list)
    missing_token_ids: int = 0  # LLM calls recorded without engine token ids

    @property
    def total_reward(self) -> float | None:
        values = [c.reward for c in self.llm_calls if c.reward is not None]
        return math.fsum(values) if values else self.final_reward


class Sample(_Record):
    """What a trainer consumes: one LLM call, or a whole trajectory merged by exact token prefix."""

    rollout_id: str | None = None
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_logprobs: list[float] | None = None
    reward: float | None = None
    token_rewards: list[float] | None = None
    group_id: str | None = None
    agent_name: str | None = None
    #: The served model name the calls went to (under multi-LoRA serving, the LoRA's name): the
    #: policy that trains on this sample (``route_by_policy``).
    policy: str | None = None
    policy_version: int | None = None
    llm_call_indices: list[int] = Field(default_factory=list)
