"""Conversations for supervised fine-tuning (``lightning-rl export --format chat``).

One example per (rollout, agent): the agent's last LLM call of the rollout, its request messages and
its answer, with the tool definitions it was given. That is the conversational format TRL's
``SFTTrainer`` and Hugging Face chat templates read (``{"messages": [...], "tools": [...]}``); the
rollout id, group, agent, reward and policy version ride along for filtering and provenance.

Decided: a tool call's ``arguments`` are written as the JSON object they encode (chat templates
serialize a dict themselves, and a string would be encoded twice); arguments that are not valid JSON
stay the string the model wrote. Only succeeded rollouts are exported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import semconv
from ..errors import ConfigurationError
from .assembly import assemble
from .training_samples import _agent_filter


@dataclass
class ChatExportStats:
    examples: int = 0
    rollouts_read: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    fn = dict(tc["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            parsed = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**tc, "function": fn}


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if v is not None}
    calls = out.get("tool_calls")
    if calls and isinstance(calls, list):  # tool calls the assembly could not read are left out (it counted them)
        out["tool_calls"] = [_tool_call(tc) for tc in calls if isinstance(tc, dict) and isinstance(tc.get("function"), dict)]
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


def chat_examples(store: Any, *, mode: str | None = None, agents: str | Sequence[str] | None = None,
                  min_reward: float | None = None, max_reward: float | None = None,
                  min_policy_version: int | None = None, best_of_group: bool = False,
                  reward_name: str = "reward") -> tuple[list[dict[str, Any]], ChatExportStats]:
    """The examples (module doc) and what was skipped and why. ``best_of_group``: rejection-sampling data,
    the highest-rewarded try of each group (per agent; ties go to the earlier try)."""
    keep_agent = _agent_filter(agents)
    stats = ChatExportStats()
    examples: list[dict[str, Any]] = []
    rollouts = store.rollouts(mode=mode, status="succeeded", min_policy_version=min_policy_version)
    for rollout, spans, rewards in store.rollout_data([r.rollout_id for r in rollouts]):
        stats.rollouts_read += 1
        traj = assemble(rollout, spans, rewards, reward_name=reward_name)
        reward = traj.final_reward
        if (min_reward is not None or max_reward is not None) and reward is None:
            stats.skip("no reward")
            continue
        if (min_reward is not None and reward < min_reward) or (max_reward is not None and reward > max_reward):
            stats.skip("reward out of range")
            continue
        tools_of = {s.span_id: s.attributes.get(semconv.GEN_AI_TOOL_DEFINITIONS) for s in spans}
        last: dict[str | None, Any] = {}
        for call in traj.llm_calls:
            last[call.agent_name] = call
        if not last:
            stats.skip("no LLM call")
            continue
        for agent, call in last.items():
            if not keep_agent(agent):
                stats.skip("agent not asked for")
                continue
            if not call.output_messages:
                stats.skip("call without an answer")
                continue
            example: dict[str, Any] = {"messages": [_message(m) for m in [*call.input_messages, *call.output_messages]]}
            tools = tools_of.get(call.span_id)
            if isinstance(tools, str):
                try:
                    tools = json.loads(tools)
                except json.JSONDecodeError:
                    stats.skip("tool definitions not JSON (left out)")
                    tools = None
            if isinstance(tools, list) and tools:
                example["tools"] = tools
            example.update(rollout_id=rollout.rollout_id, group_id=rollout.group_id, attempt=rollout.attempt,
                           agent=agent, reward=reward, policy_version=call.policy_version)
            examples.append(example)
    if best_of_group:
        best: dict[tuple[Any, Any], dict[str, Any]] = {}
        for ex in examples:
            key = (ex["group_id"] or ex["rollout_id"], ex["agent"])
            kept = best.get(key)
            score = ex["reward"] if ex["reward"] is not None else float("-inf")
            if kept is None or score > (kept["reward"] if kept["reward"] is not None else float("-inf")) or (
                    score == kept["reward"] and ex["attempt"] < kept["attempt"]):
                if kept is not None:
                    stats.skip("not the best of its group")
                best[key] = ex
            else:
                stats.skip("not the best of its group")
        examples = list(best.values())
    stats.examples = len(examples)
    if not examples:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.skipped.items())) or "none matched"
        raise ConfigurationError(
            f"the export matched no conversation ({stats.rollouts_read} succeeded rollouts read"
            f"{'; skipped: ' + why if stats.skipped else ''}); loosen the filters (--mode, --agents, --min-reward, "
            "--max-reward, --min-policy-version)")
    return examples, stats
