"""A verl agent loop that runs a traced agent: verl's trainer, your unmodified agent.

Registered as ``lightning_rl`` (verl's ``@register``). Configure it under ``lightning_rl`` in verl's
trainer config and pick it for dataset rows (``agent_name: lightning_rl``) or as
``actor_rollout_ref.rollout.agent.default_agent_loop``:

    lightning_rl:
      agent: my_package.agents:solve      # a @lrl.trace function (async or sync), importable
      store: null                         # where its spans go: LIGHTNING_RL_STORE (train verl --store sets
                                          # it in verl's processes; a URL here must hold no password: verl
                                          # prints its config); several nodes need a store server or PostgreSQL
      rollouts: in_worker                 # or external: runners anywhere run the agent (store's queue)
      agents: null                        # names / regex of the agents to train (multi-agent)
      credit: final                       # credit assignment for each segment's reward
      failure_reward: 0.0                 # reward of a try the model made fail (trained on)
      infra_errors: []                    # more exception names that mean "not the model"
      guided_decoding: mask               # or train: segments sampled under a grammar (no gradient by default)

For each dataset row, ``run`` takes one of verl's own vLLM servers from verl's load balancer (its OpenAI
HTTP address) and reads the weight version that server serves. ``in_worker``: it runs the agent here,
with ``lrl.current_endpoint()`` set to that address and the served model. ``external``: it queues the
task in the store with that endpoint and verl's sampling, and waits for a runner (``lightning-rl
runner`` in any process or machine, a Ray runner, or ``lrl.command`` for agents in other languages) to
run it. Either way it then reads the rollout back from the store and returns its rows
(``rows.rollout_rows``): one per trained segment, with the engine's token ids (tool tokens masked
0), log-probs, the reward after credit, and the weight versions V1 reads (``min_global_steps``,
``max_global_steps``).

* verl's ``sampling_params`` (temperature, top_p, top_k; validation's too) are imposed on the
  agent's requests (``rollout_overrides(sampling=...)``), so the actor's log-probs are taken at the
  temperature the tokens were drawn at.
* Calls are stamped with the run's versions (``runs.py``: base + the server's global step).
* ``external``: a try no runner finished within ``external_timeout`` is cancelled in the store's queue.
* The loop refuses, as the launch does (``launch.check_verl_config``), what would lose rows or train
  the wrong thing: verl's legacy trainer (one row per try: it cannot take every segment), an async trainer
  mode, a rollout engine without token ids, a LoRA that the OpenAI routes would not serve, an estimator
  other than GRPO, KL in the reward, a reward model, a store URL with a password in the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the verl agent loop needs verl: pip install 'lightning-rl[verl]'") from exc

from ..._api import configure
from ...diagnostics import count, report_failure
from ...errors import ConfigurationError
from ...records import SAMPLING_KEYS, QueueStatus
from ...store.queries import policy_versions, trajectory
from ...store.uri import redacted
from ...tracer import rollout_overrides
from ...tracer.provider import tracing
from ..failures import INFRA_ERRORS
from ..agent_loading import load_agent
from .launch import check_verl_config, check_verl_version, served_model_name
from .rows import Row, rollout_rows
from .runs import version_base

ROLLOUT_MODES = ("in_worker", "external")


@register("lightning_rl")
class LightningRLAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_verl_version()
        check_verl_config(self.config)
        cfg = self.config.get("lightning_rl") or {}
        if not cfg.get("agent") and cfg.get("rollouts", "in_worker") == "in_worker":
            raise ConfigurationError("set lightning_rl.agent to the traced agent, e.g. my_package.agents:solve")
        self.mode = cfg.get("rollouts") or "in_worker"
        if self.mode not in ROLLOUT_MODES:
            raise ConfigurationError(f"lightning_rl.rollouts={self.mode!r} is not one of {', '.join(ROLLOUT_MODES)}")
        self.agent = load_agent(cfg["agent"]) if self.mode == "in_worker" else None
        self.store = configure(store=cfg.get("store")) if cfg.get("store") else configure()
        self.agents = cfg.get("agents")
        self.credit = cfg.get("credit", "final")
        self.model = cfg.get("model") or served_model_name(self.config)
        self.server_url = cfg.get("server_url")  # tests / standalone servers; verl picks one otherwise
        self.failure_reward = float(cfg.get("failure_reward", 0.0))
        self.infra_errors = INFRA_ERRORS | frozenset(cfg.get("infra_errors") or ())
        self.external_timeout = float(cfg.get("external_timeout", 600.0))
        self.version_base = version_base()
        self.mask_guided = cfg.get("guided_decoding", "mask") == "mask"

    @contextlib.asynccontextmanager
    async def _server(self, request_id: str) -> AsyncIterator[tuple[str, Any]]:
        """The base URL of the vLLM server this rollout talks to and its actor handle (None for a
        standalone server), held for the rollout's length."""
        if self.server_url:
            yield self.server_url.rstrip("/").removesuffix("/v1") + "/v1", None
            return
        async with verl_server(self.server_manager, request_id) as (address, handle):
            yield f"http://{address}/v1", handle

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        task = task_of(kwargs)
        rollout_id = uuid.uuid4().hex
        uid = kwargs.get("uid")
        group = str(uid) if uid is not None else None
        # The actor recomputes log-probs at verl's temperature: the agent samples at it too.
        sampling = {k: sampling_params[k] for k in SAMPLING_KEYS if sampling_params.get(k) is not None} or None
        async with self._server(rollout_id) as (base_url, handle):
            first = await server_version(handle)
            if first is not None:  # the agent's calls are stamped with the weights the server serves, in the
                tracing.set_policy_version(self.version_base + first, self.model)  # run's numbering (runs.py)
            if self.mode == "external":
                rollout_id = await self._run_external(task, group, base_url, sampling)
            else:
                await self._run_here(task, rollout_id, group, base_url, sampling)
            last = await server_version(handle)
        versions = (first, last if last is not None else first) if first is not None else None
        if rollout_id is None:  # no runner took the task in time
            rows = [external_timeout_row(self.tokenizer, versions, kwargs.get("global_steps"), self.external_timeout)]
        else:
            # Store reads block: off verl's event loop, which runs every other rollout of the worker.
            await asyncio.to_thread(self.store.flush)
            rows = await asyncio.to_thread(self.rows, rollout_id, versions, kwargs.get("global_steps"))
        return [as_output(row) for row in rows]

    async def _run_here(self, task: Any, rollout_id: str, group: str | None, base_url: str,
                        sampling: dict[str, Any] | None) -> None:
        with rollout_overrides(rollout_id=rollout_id, task=task, mode="train", endpoint=(base_url, self.model),
                               sampling=sampling, **({"group_id": group} if group is not None else {})):
            try:
                if inspect.iscoroutinefunction(self.agent):
                    await self.agent(task)
                else:
                    await asyncio.to_thread(contextvars.copy_context().run, self.agent, task)
            except Exception:
                pass  # recorded on the rollout as failed

    async def _run_external(self, task: Any, group: str | None, base_url: str,
                            sampling: dict[str, Any] | None) -> str | None:
        """Queue the try for a runner elsewhere and wait until it is done; its rollout id, or None when no
        runner finished it within ``external_timeout`` (counted, logged once)."""
        overrides = {"endpoint": [base_url, self.model], **({"sampling": sampling} if sampling else {})}
        (entry,) = await asyncio.to_thread(self.store.enqueue, task, n=1, mode="train", group_id=group,
                                           overrides=overrides)
        deadline = time.monotonic() + self.external_timeout
        while time.monotonic() < deadline:
            done = await asyncio.to_thread(self._done_rollout, entry)
            if done is not None:
                return done
            await asyncio.sleep(0.2)
        try:  # a runner that leased it late would call verl's server mid-sync and record a stray rollout
            cancelled = await asyncio.to_thread(
                self.store.cancel, [entry.queue_id],
                reason=f"verl's lightning_rl.external_timeout of {self.external_timeout:.0f} s ran out")
        except Exception as exc:  # noqa: BLE001 - the row is one without gradient all the same
            report_failure("cancelling a timed-out verl try", exc)
            cancelled = [entry.queue_id]
        if not cancelled:  # it was done in the meantime: its rows after all
            done = await asyncio.to_thread(self._done_rollout, entry)
            if done is not None:
                return done
        report_failure("verl external rollout wait", message=(
            f"lightning-rl: no runner finished a queued verl try within {self.external_timeout:.0f} s "
            f"(lightning_rl.external_timeout); start runners on the store ({redacted(str(self.store.url))}), e.g. "
            "`lightning-rl runner --agent my_pkg.agents:solve`; such tries are cancelled in the queue and leave their "
            "group out of the batch (counted, logged once)"))
        return None

    def _done_rollout(self, entry: Any) -> str | None:
        """The rollout id of the queued try ``entry`` once it is done, else None."""
        found = [e for e in self.store.queue_entries([entry.group_id]) if e.queue_id == entry.queue_id]
        return found[0].rollout_id if found and found[0].status == QueueStatus.DONE and found[0].rollout_id else None

    def rows(self, rollout_id: str, versions: tuple[int, int] | None, global_steps: int | None) -> list[Row]:
        traj = trajectory(self.store, rollout_id, credit=self.credit)
        known = policy_versions(self.store)
        rows = rollout_rows(
            traj, response_length=self.rollout_config.response_length,
            pad_token_id=pad_id(self.tokenizer), agents=self.agents, failure_reward=self.failure_reward,
            infra_errors=self.infra_errors, versions=versions, global_steps=global_steps,
            version_base=self.version_base, mask_guided=self.mask_guided,
            policy_version=traj.policy_version if self.model in known else None)
        count("verl_rows", len(rows))
        count("verl_rows_masked", sum(1 for r in rows if r.extra_fields["masked"]))
        return rows

    def output(self, traj: Any) -> list[AgentLoopOutput]:
        """The outputs for an already finished rollout (its trajectory): ``run`` without running anything."""
        return [as_output(r) for r in self.rows(traj.rollout_id, None, None)]


def task_of(row: dict[str, Any]) -> Any:
    """The task a dataset row hands the agent: ``extra_info.task_json`` (what ``train verl --tasks`` writes),
    ``extra_info.task``, else the row's ``raw_prompt``."""
    import json

    extra = row.get("extra_info") or {}
    if extra.get("task_json") is not None:
        return json.loads(extra["task_json"])
    return extra.get("task", row.get("raw_prompt"))


def pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def as_output(row: Row) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=row.prompt_ids, response_ids=row.response_ids, response_mask=row.response_mask,
                           response_logprobs=row.response_logprobs, reward_score=row.reward_score,
                           num_turns=row.num_turns, metrics=AgentLoopMetrics(), extra_fields=row.extra_fields)


def external_timeout_row(tokenizer: Any, versions: tuple[int, int] | None, global_steps: int | None,
                         timeout: float) -> Row:
    pad = pad_id(tokenizer)
    step = versions or (max(int(global_steps or 1) - 1, 0),) * 2
    count("verl_external_timeouts")
    return Row([pad], [pad], [0], [0.0], 0.0, 0, {
        "rollout_id": "", "prefix_splits": 0, "segments": 1, "segment": 0, "status": "timed_out",
        "failure": "infra", "policy_version": None, "reward_extra_info": {}, "masked": "external_timeout",
        "min_global_steps": step[0], "max_global_steps": step[1],
        "version_source": "server" if versions else "step", "external_timeout": timeout, "segment_reward": 0.0})


def _global_steps(actor: Any) -> Any:
    return getattr(actor, "global_steps", None)


async def server_version(handle: Any) -> int | None:
    """The weight version (verl's global steps) the vLLM server actor ``handle`` serves now, read through
    Ray's ``__ray_call__`` (verl 0.9.1's server keeps it in ``global_steps``, set at every weight sync and
    not exposed by a method); None when there is no handle or no version yet."""
    call = getattr(handle, "__ray_call__", None) if handle is not None else None
    if call is None:
        return None
    try:
        value = await call.remote(_global_steps)
    except Exception as exc:  # noqa: BLE001 - the rows fall back to the calls' versions
        report_failure("reading a verl server's weight version", exc)
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


@contextlib.asynccontextmanager
async def verl_server(server_manager: Any, request_id: str) -> AsyncIterator[tuple[str, Any]]:
    """Hold one of verl's vLLM servers (its address and actor handle) from verl's load balancer, and give
    it back.

    verl 0.9 has no public call for "a server for an OpenAI client": ``LLMServerClient.generate``
    acquires and releases around its own token-level request. This uses the same two methods
    (``_acquire_server`` / ``_release_server``, private) and always releases, so the balancer's in-flight
    counts stay right; ``request_id`` is passed to the release only where it takes one (0.9.1 does,
    0.9.0 does not)."""
    acquire = getattr(server_manager, "_acquire_server", None)
    release = getattr(server_manager, "_release_server", None)
    if acquire is None or release is None:
        raise ConfigurationError(
            f"{type(server_manager).__name__} has no _acquire_server/_release_server (lightning-rl was checked "
            "against verl 0.9.1); set lightning_rl.server_url to a vLLM server's address, or use verl 0.9.1")
    server_id, handle = await acquire(request_id)
    try:
        yield server_id, handle
    finally:
        if "request_id" in inspect.signature(release).parameters:
            release(server_id, request_id=request_id)
        else:
            release(server_id)
