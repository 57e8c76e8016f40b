"""Helpers for driving verl 0.9.1's V1 trainer code on CPU: a local Ray with a real TransferQueue, verl's V1
agent-loop worker, its replay buffer and the trainer step's own advantage and metrics functions."""

from __future__ import annotations

import sys
import threading
import traceback
from types import SimpleNamespace

import pytest

from ..conftest import ensure_tiny_model


@pytest.fixture(scope="module")
def transfer_queue():
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"storage_backend": "SimpleStorage",
                                          "SimpleStorage": {"total_storage_size": 1000, "num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


def within(seconds: float, fn, *args, **kwargs):
    """``fn``'s result, or a test failure after ``seconds``: verl's replay buffer and TransferQueue calls wait
    without a limit, and a test must fail, not hang, when what they wait for never comes."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():  # where it waits, so that a hang seen once in CI says what it waited for
        frame = sys._current_frames().get(thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not finish within {seconds} s; it waits at:\n{stack}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def compose_config(db, *, prompt_length: int, response_length: int, n: int, agent: str, **lightning):
    """Our packaged config composed with verl's own (as ``train verl`` runs it), for the tiny model."""
    from hydra import compose, initialize_config_dir

    from lightning_rl.trainer_bridge.verl_launch import CONFIG_DIR, CONFIG_NAME

    overrides = [f"actor_rollout_ref.model.path={ensure_tiny_model()}",
                 f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
                 f"actor_rollout_ref.rollout.response_length={response_length}", f"actor_rollout_ref.rollout.n={n}",
                 f"lightning_rl.agent={agent}", f"lightning_rl.store=sqlite:///{db}", "lightning_rl.model=tiny"]
    overrides += [f"lightning_rl.{k}={v}" for k, v in lightning.items()]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(CONFIG_NAME, overrides=overrides)


def v1_worker(config, tokenizer=None):
    """verl's V1 agent-loop worker (its class under ray.remote), without the actor. With a tokenizer: only the
    methods that put outputs into the TransferQueue; without: verl's own constructor (tools, registry, tq)."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__ray_actor_class__
    if tokenizer is None:
        return cls(config, llm_client=None)
    worker = cls.__new__(cls)
    worker.config, worker.rollout_config = config, config.actor_rollout_ref.rollout
    worker.tokenizer, worker.processor, worker.hf_model_type = tokenizer, None, "qwen2"
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.mm_processor_kwargs = None, False, {}
    return worker


def train_step(tq, config, *, uids: int, global_steps: int):
    """V1's sync step on what the workers put: the replay buffer's sample, the actor's old log-probs (here the
    engine's: its GPU recomputation is the one step not run), ``_compute_advantage`` and ``_compute_metrics``.
    Returns (the batch, its metrics, the advantages and response masks by key)."""
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer, RolloutMoELoadBalanceMetricsAccumulator

    buffer = ReplayBuffer(trainer_mode="sync", trainer_config=config.trainer.v1.get("sync", {}),
                          max_off_policy_threshold=None, max_off_policy_strategy="drop",
                          sampler_kwargs=config.trainer.v1.sampler, poll_interval=0.1, train_batch_size=uids)
    batch, _ = within(300, buffer.sample, global_steps=global_steps, partition_id="train", batch_size=uids)
    engine = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["rollout_log_probs"])
    tq.kv_batch_put(keys=batch.keys, partition_id="train",
                    fields=TensorDict({"old_log_probs": engine["rollout_log_probs"]}, batch_size=len(batch.keys)))
    trainer = SimpleNamespace(config=config, use_critic=False, _get_n_gpus_for_throughput=lambda: 1,
                              _rollout_moe_lb_metrics_accumulator=RolloutMoELoadBalanceMetricsAccumulator(
                                  model_config=config.actor_rollout_ref.model))
    metrics: dict = {}
    batch = PPOTrainer._compute_advantage(trainer, batch, metrics)
    PPOTrainer._compute_metrics(trainer, batch, metrics, {"step": 1.0}, global_steps=global_steps, epoch=0)
    data = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["response_mask", "advantages"])
    by_key = {k: (m, a) for k, m, a in zip(batch.keys, data["response_mask"], data["advantages"])}
    return batch, metrics, by_key
