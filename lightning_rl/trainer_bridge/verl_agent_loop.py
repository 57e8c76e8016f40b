"""A verl agent loop that runs a traced agent: verl's trainer, your unmodified agent.

Registered as ``lightning_rl`` (verl's ``@register``). Configure it under ``lightning_rl`` in verl's
trainer config and pick it for dataset rows (``agent_name: lightning_rl``) or as
``actor_rollout_ref.rollout.agent.default_agent_loop``:

    lightning_rl:
      agent: my_package.agents:solve      # a @lrl.trace function (async or sync), importable
      store: http://head-node:8765        # where its spans go (default: LIGHTNING_RL_STORE); several
                                          # nodes need the store server, never a shared SQLite file
      agents: null                        # names / regex of the agents to train (multi-agent)
      credit: final                       # credit assignment for the merged sample's reward

For each dataset row, ``run`` picks one of verl's own vLLM servers (its OpenAI HTTP address),
runs the agent with ``lrl.current_endpoint()`` set to that address and the served model, then
builds a trajectory-level sample from the store. It returns it as an ``AgentLoopOutput``: the
engine's prompt and response ids (tool tokens masked 0), its log-probs, and the reward. verl's
padding, GRPO grouping, weight sync and async modes then apply unchanged. A failed rollout
returns reward 0.0 (never a success). When the trajectory splits into several samples (a broken
token prefix), the last one is returned and the split is reported in ``extra_fields``.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import uuid
from typing import Any

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the verl agent loop needs verl: pip install 'lightning-rl[verl]'") from exc

from .._api import configure
from ..errors import ConfigurationError
from ..records import RolloutStatus
from ..store.samples import trajectory_samples
from ..tracer import rollout_overrides
from .runner import load_agent


@register("lightning_rl")
class LightningRLAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config.get("lightning_rl") or {}
        if not cfg.get("agent"):
            raise ConfigurationError("set lightning_rl.agent to the traced agent, e.g. my_package.agents:solve")
        self.agent = load_agent(cfg["agent"])
        self.store = configure(store=cfg.get("store")) if cfg.get("store") else configure()
        self.agents = cfg.get("agents")
        self.credit = cfg.get("credit", "final")
        self.model = cfg.get("model") or self.config.actor_rollout_ref.model.path
        self.server_url = cfg.get("server_url")  # tests / standalone servers; verl picks one otherwise

    async def _base_url(self, request_id: str) -> str:
        if self.server_url:
            return self.server_url.rstrip("/").removesuffix("/v1") + "/v1"
        address, _ = await self.server_manager._acquire_server(request_id)  # verl 0.9's load balancer
        return f"http://{address}/v1"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = (kwargs.get("extra_info") or {}).get("task", kwargs.get("raw_prompt"))
        rollout_id = uuid.uuid4().hex
        base_url = await self._base_url(rollout_id)
        uid = kwargs.get("uid")
        with rollout_overrides(rollout_id=rollout_id, task=task, mode="train", endpoint=(base_url, self.model),
                               **({"group_id": str(uid)} if uid is not None else {})):
            try:
                if inspect.iscoroutinefunction(self.agent):
                    await self.agent(task)
                else:
                    await asyncio.to_thread(contextvars.copy_context().run, self.agent, task)
            except Exception:
                pass  # recorded on the rollout as failed; the reward below is 0.0
        self.store.flush()
        traj = self.store.trajectory(rollout_id, credit=self.credit)
        samples, stats = trajectory_samples(traj, level="trajectory", agents=self.agents)
        length = self.rollout_config.response_length
        extra = {"rollout_id": rollout_id, "prefix_splits": stats.splits, "status": traj.status.value}
        if not samples:  # nothing to train on: a fully masked placeholder verl can still batch
            prompt = traj.llm_calls[0].prompt_token_ids if traj.llm_calls else [self.tokenizer.pad_token_id or 0]
            return AgentLoopOutput(prompt_ids=prompt, response_ids=[self.tokenizer.pad_token_id or 0], response_mask=[0],
                                   reward_score=0.0, num_turns=0, metrics=AgentLoopMetrics(), extra_fields=extra)
        sample = samples[-1]
        succeeded = traj.status == RolloutStatus.SUCCEEDED
        extra["policy_version"] = sample.policy_version
        return AgentLoopOutput(
            prompt_ids=sample.prompt_ids,
            response_ids=sample.response_ids[:length],
            response_mask=sample.response_mask[:length],
            response_logprobs=sample.rollout_logprobs[:length] if sample.rollout_logprobs is not None else None,
            reward_score=float(sample.reward or 0.0) if succeeded else 0.0,
            num_turns=2 * len(sample.llm_call_indices) + 1,
            metrics=AgentLoopMetrics(),
            extra_fields=extra,
        )
