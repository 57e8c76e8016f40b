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
      failure_reward: 0.0                 # reward of a try the model made fail (trained on)
      infra_errors: []                    # more exception names that mean "not the model"

For each dataset row, ``run`` picks one of verl's own vLLM servers (its OpenAI HTTP address),
runs the agent with ``lrl.current_endpoint()`` set to that address and the served model, then
builds a trajectory-level sample from the store. It returns it as an ``AgentLoopOutput``: the
engine's prompt and response ids (tool tokens masked 0), its log-probs, and the reward. verl's
padding, GRPO grouping, weight sync and async modes then apply unchanged.

* verl's ``sampling_params`` (temperature, top_p, top_k; validation's too) are imposed on the
  agent's requests (``rollout_overrides(sampling=...)``), so the actor's log-probs are taken at the
  temperature the tokens were drawn at.
* Failures follow ``failures.failure_kind``, as in the local trainer: a try the model made fail is
  trained on with ``failure_reward``; an infrastructure failure is kept as a row without gradient
  (verl's agent-loop interface returns one row per try, so the group cannot be dropped from here;
  its reward 0.0 still enters the group's baseline; ``extra_fields["failure"]`` marks it).
* Every row has ``response_logprobs`` and a prompt within ``rollout.prompt_length``: a placeholder
  (no usable LLM call), a sample without engine log-probs and an over-long prompt (left-truncated)
  are rows with the response mask all 0, ``extra_fields["masked"]`` saying why.
* When the trajectory splits into several samples (a broken token prefix), the last one is
  returned and the split is reported in ``extra_fields``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import uuid
from collections.abc import AsyncIterator
from typing import Any

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the verl agent loop needs verl: pip install 'lightning-rl[verl]'") from exc

from .._api import configure
from ..errors import ConfigurationError
from ..records import Trajectory
from ..store.queries import policy_versions, trajectory
from ..store.training_samples import trajectory_samples
from ..tracer import rollout_overrides
from ..tracer.decorator import SAMPLING_KEYS
from .failures import INFRA_ERRORS, failure_kind
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
        self.failure_reward = float(cfg.get("failure_reward", 0.0))
        self.infra_errors = INFRA_ERRORS | frozenset(cfg.get("infra_errors") or ())

    @contextlib.asynccontextmanager
    async def _server(self, request_id: str) -> AsyncIterator[str]:
        """The base URL of the vLLM server this rollout talks to, held for the rollout's length."""
        if self.server_url:
            yield self.server_url.rstrip("/").removesuffix("/v1") + "/v1"
            return
        async with verl_server(self.server_manager, request_id) as address:
            yield f"http://{address}/v1"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = (kwargs.get("extra_info") or {}).get("task", kwargs.get("raw_prompt"))
        rollout_id = uuid.uuid4().hex
        uid = kwargs.get("uid")
        # The actor recomputes log-probs at verl's temperature: the agent samples at it too.
        sampling = {k: sampling_params[k] for k in SAMPLING_KEYS if sampling_params.get(k) is not None}
        async with self._server(rollout_id) as base_url:
            with rollout_overrides(rollout_id=rollout_id, task=task, mode="train", endpoint=(base_url, self.model),
                                   sampling=sampling or None, **({"group_id": str(uid)} if uid is not None else {})):
                try:
                    if inspect.iscoroutinefunction(self.agent):
                        await self.agent(task)
                    else:
                        await asyncio.to_thread(contextvars.copy_context().run, self.agent, task)
                except Exception:
                    pass  # recorded on the rollout as failed
        # Store reads block: off verl's event loop, which runs every other rollout of the worker.
        await asyncio.to_thread(self.store.flush)
        traj = await asyncio.to_thread(trajectory, self.store, rollout_id, credit=self.credit)
        return await asyncio.to_thread(self.output, traj)  # it reads the store's publishes too

    def output(self, traj: Trajectory) -> AgentLoopOutput:
        """The verl row for a finished rollout. Every row has log-probs and fits verl's lengths, so
        rows concatenate; a row that must not be trained on is kept with its response mask all 0
        (``extra_fields["masked"]`` says why)."""
        samples, stats = trajectory_samples(traj, level="trajectory", agents=self.agents)
        kind = failure_kind(traj, self.infra_errors)
        versions = policy_versions(self.store)
        extra: dict[str, Any] = {"rollout_id": traj.rollout_id, "prefix_splits": stats.splits,
                                 "status": traj.status.value, "failure": kind or "",
                                 # verl syncs its own weights: a version only where a publish was recorded
                                 "policy_version": traj.policy_version if self.model in versions else None}
        reward = self.failure_reward if kind == "model" else 0.0 if kind == "infra" else None
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if not samples:  # nothing to train on: a fully masked placeholder verl can still batch
            prompt = traj.llm_calls[0].prompt_token_ids if traj.llm_calls and traj.llm_calls[0].prompt_token_ids else [pad]
            return self._row(prompt, [pad], [0], [0.0], reward or 0.0, 0, extra, masked="no_sample")
        sample = samples[-1]
        if reward is None:
            reward = float(sample.reward or 0.0)
        length = self.rollout_config.response_length
        ids, mask = sample.response_ids[:length], sample.response_mask[:length]
        masked = "infra_failure" if kind == "infra" else None
        logprobs = sample.rollout_logprobs[:length] if sample.rollout_logprobs is not None else None
        if logprobs is None or len(logprobs) != len(ids):
            logprobs, masked = [0.0] * len(ids), masked or "no_engine_logprobs"
        return self._row(sample.prompt_ids, ids, mask, logprobs, reward, 2 * len(sample.llm_call_indices) + 1,
                         extra, masked=masked)

    def _row(self, prompt: list[int], ids: list[int], mask: list[int], logprobs: list[float], reward: float,
             turns: int, extra: dict[str, Any], *, masked: str | None) -> AgentLoopOutput:
        limit = self.rollout_config.prompt_length
        if len(prompt) > limit:  # verl pads to prompt_length and cannot batch a longer row
            prompt, masked = prompt[-limit:], masked or "prompt_too_long"
        if masked:  # the row keeps its shape, without gradient (its context or its log-probs are not the engine's)
            mask = [0] * len(ids)
        extra["masked"] = masked or ""
        return AgentLoopOutput(prompt_ids=list(prompt), response_ids=list(ids), response_mask=list(mask),
                               response_logprobs=list(logprobs), reward_score=float(reward), num_turns=turns,
                               metrics=AgentLoopMetrics(), extra_fields=extra)


@contextlib.asynccontextmanager
async def verl_server(server_manager: Any, request_id: str) -> AsyncIterator[str]:
    """Hold one of verl's vLLM servers (its address) from verl's load balancer, and give it back.

    verl 0.9.1 has no public call for "a server for an OpenAI client": ``LLMServerClient.generate``
    acquires and releases around its own token-level request. This uses the same two methods
    (``_acquire_server`` / ``_release_server``, private, checked against 0.9.1) and always releases,
    so the balancer's in-flight counts stay right."""
    acquire = getattr(server_manager, "_acquire_server", None)
    release = getattr(server_manager, "_release_server", None)
    if acquire is None or release is None:
        raise ConfigurationError(
            f"{type(server_manager).__name__} has no _acquire_server/_release_server (lightning-rl was checked "
            "against verl 0.9.1); set lightning_rl.server_url to a vLLM server's address, or use verl 0.9.1")
    server_id, _ = await acquire(request_id)
    try:
        yield server_id
    finally:
        release(server_id, request_id=request_id)
