"""The local backend: LoRA (PEFT) on the served base model, on CPU or one GPU, with verl's math.

``update(samples)`` is one policy-gradient step on a batch of samples:

1. log-probs of the sampled response tokens are recomputed by the trainer (``old_log_prob``; the
   engine's ``rollout_logprobs`` are kept only to report how far they are, ``engine_logprob_gap``:
   vLLM returns raw log-probs, before temperature, so sample at temperature 1.0 to compare);
2. the reward sits on the last response token; advantages come from the estimator registry
   (``grpo`` by default, grouped by ``group_id``);
3. PPO-clip over ``response_mask`` (0 on tool/observation tokens), token-mean aggregation,
   optional KL to the base model (the same weights with the adapter disabled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError
from ..records import Sample
from .algorithms import agg_loss, get_adv_estimator, get_policy_loss, kl_penalty, masked_mean

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LocalConfig:
    lr: float = 2e-4
    lora_rank: int = 16
    lora_alpha: int = 32
    target_modules: tuple[str, ...] = TARGET_MODULES
    adv_estimator: str = "grpo"
    policy_loss: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    ppo_epochs: int = 1
    micro_batch_size: int = 32
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    dtype: str = "float32"  # "bfloat16" on a GPU
    adv_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    prompt_lengths: torch.Tensor  # [B]
    response_mask: torch.Tensor  # [B, R] 1 = generated token in the loss
    response_valid: torch.Tensor  # [B, R] 1 = a response token (generated or observation)
    token_level_rewards: torch.Tensor  # [B, R]
    index: np.ndarray  # group ids
    engine_logprobs: torch.Tensor | None


def build_batch(samples: list[Sample], pad_token_id: int) -> Batch:
    if not samples:
        raise ConfigurationError("cannot build a batch from no samples")
    rows = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, rows))
    resp_width = max(len(s.response_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response_mask = torch.zeros((n, resp_width))
    response_valid = torch.zeros((n, resp_width))
    rewards = torch.zeros((n, resp_width))
    engine = torch.zeros((n, resp_width)) if all(s.rollout_logprobs is not None for s in samples) else None
    for i, (s, row) in enumerate(zip(samples, rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        r = len(s.response_ids)
        response_mask[i, :r] = torch.tensor(s.response_mask, dtype=torch.float32)
        response_valid[i, :r] = 1
        if r:  # the scalar reward at the last response token (token_rewards are credited values, not summable)
            rewards[i, r - 1] = float(s.reward or 0.0)
        if engine is not None:
            engine[i, :r] = torch.tensor(s.rollout_logprobs)
    index = np.array([s.group_id or s.rollout_id or str(i) for i, s in enumerate(samples)], dtype=object)
    return Batch(input_ids, attention, torch.tensor([len(s.prompt_ids) for s in samples]), response_mask,
                 response_valid, rewards, index, engine)


class LocalBackend:
    """Holds the PEFT model and its optimizer; ``model`` is what a publisher saves."""

    def __init__(self, model_dir: str | Path, config: LocalConfig | None = None, *, seed: int = 0,
                 device: str | None = None) -> None:
        try:
            import peft
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise ImportError("the local trainer needs peft: pip install 'lightning-rl[local]'") from exc
        self.config = config or LocalConfig()
        torch.manual_seed(seed)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, self.config.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigurationError(f"dtype {self.config.dtype!r} is not a torch dtype; use float32 or bfloat16")
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.pad_token_id = AutoTokenizer.from_pretrained(str(model_dir)).pad_token_id or 0
        lora = peft.LoraConfig(r=self.config.lora_rank, lora_alpha=self.config.lora_alpha, lora_dropout=0.0,
                               target_modules=list(self.config.target_modules))
        self.model = peft.get_peft_model(base, lora).to(self.device)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=0.0)
        self.estimator = get_adv_estimator(self.config.adv_estimator)
        self.policy_loss = get_policy_loss(self.config.policy_loss)

    def response_logprobs(self, batch: Batch, rows: slice) -> torch.Tensor:
        """[b, R] log-probs of the response tokens of ``batch[rows]`` under the current model."""
        ids = batch.input_ids[rows].to(self.device)
        mask = batch.attention_mask[rows].to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits / self.config.temperature
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        width = batch.response_mask.shape[1]
        out = torch.zeros((ids.shape[0], width), device=self.device)
        for i, start in enumerate(batch.prompt_lengths[rows].tolist()):
            length = int(batch.response_valid[rows][i].sum().item())
            out[i, :length] = logp[i, start - 1: start - 1 + length]
        return out

    def _all_logprobs(self, batch: Batch) -> torch.Tensor:
        step = self.config.micro_batch_size
        return torch.cat([self.response_logprobs(batch, slice(i, i + step)) for i in range(0, len(batch.index), step)])

    def update(self, samples: list[Sample]) -> dict[str, float]:
        cfg = self.config
        batch = build_batch(samples, self.pad_token_id)
        mask = batch.response_mask.to(self.device)
        with torch.no_grad():
            old = self._all_logprobs(batch)
            ref = None
            if cfg.kl_coef:
                with self.model.disable_adapter():
                    ref = self._all_logprobs(batch)
        advantages, _ = self.estimator(batch.token_level_rewards.to(self.device), mask, batch.index, **cfg.adv_kwargs)
        stats: dict[str, float] = {}
        n = len(samples)
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(0, n, cfg.micro_batch_size):
                rows = slice(start, start + cfg.micro_batch_size)
                log_prob = self.response_logprobs(batch, rows)
                loss, pg = self.policy_loss(old[rows], log_prob, advantages[rows], mask[rows],
                                            loss_agg_mode=cfg.loss_agg_mode, clip_ratio=cfg.clip_ratio)
                if ref is not None:
                    kl = agg_loss(kl_penalty(log_prob, ref[rows], cfg.kl_kind), mask[rows], cfg.loss_agg_mode)
                    loss = loss + cfg.kl_coef * kl
                    pg["kl"] = kl.item()
                (loss * (log_prob.shape[0] / n)).backward()
                for key, value in pg.items():
                    stats[key] = stats.get(key, 0.0) + value * log_prob.shape[0] / n
                stats["loss"] = stats.get("loss", 0.0) + loss.item() * log_prob.shape[0] / n
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], cfg.max_grad_norm)
            self.optimizer.step()
        rewards = batch.token_level_rewards.sum(-1)
        stats.update({
            "samples": float(n),
            "reward_mean": rewards.mean().item(),
            "advantage_abs_mean": masked_mean(advantages.abs(), mask).item(),
            "response_tokens_mean": batch.response_valid.sum(-1).mean().item(),
            "grad_norm": float(grad_norm),
        })
        if batch.engine_logprobs is not None:
            gap = masked_mean((batch.engine_logprobs.to(self.device) - old).abs(), mask).item()
            stats["engine_logprob_gap"] = gap if math.isfinite(gap) else float("nan")
        return stats
