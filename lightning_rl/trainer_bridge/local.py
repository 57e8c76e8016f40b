"""The local backend: LoRA (PEFT) on the served base model, on CPU or one GPU, with verl's math.

``update(samples)`` is one batch of policy-gradient updates. Three policies take part (the loss is
stated in docs/architecture.md, "The loss"):

* the **behaviour** policy sampled the tokens: the engine's log-probs, recorded with each call
  (vLLM serves them with ``--logprobs-mode processed_logprobs``: after temperature, as the trainer
  computes them);
* the **proximal** policy (``old``) is the trainer's model at the start of the batch: its log-probs are
  computed once per batch;
* the **current** policy is updated over ``ppo_epochs`` passes of mini-batches of
  ``mini_batch_size`` samples, one optimizer step each, so from the second mini-batch on the ratio
  current/proximal moves away from 1 and the clip acts.

Per token: PPO-clip of ratio current/proximal (dual clip for negative advantages), times the
truncated importance weight min(proximal/behaviour, ``rollout_is_threshold``) when the engine's
log-probs are there (verl's token-level ``rollout_is``). Advantages come from the estimator registry
(``grpo`` by default, groups by ``group_id``, statistics over rollouts), the reward sits on the last
response token, the loss is aggregated over ``response_mask`` (0 on tool/observation tokens), and an
optional KL to the base model (the adapter disabled) is added.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..boundaries import check_int
from ..errors import ConfigurationError
from ..records import Sample
from ..store.training_samples import group_keys
from .algorithms import agg_loss, get_adv_estimator, get_policy_loss, kl_penalty, masked_mean, rollout_is_weights
from .config import LocalConfig

def release_freed_memory() -> bool:
    """glibc's ``malloc_trim(0)``: the heap's free pages go back to the system (False where there is no
    glibc, or nothing was released)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


def set_malloc_mmap_threshold(size: int | None) -> bool:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, size)`` for this process (what ``MALLOC_MMAP_THRESHOLD_``
    sets at start-up); False where there is no glibc, or ``size`` is None."""
    if size is None:
        return False
    check_int(size, "LocalConfig.malloc_mmap_threshold", meaning="bytes, or None; 65536 for a trainer holding "
              "several policies")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-3, size))  # -3: M_MMAP_THRESHOLD; returns 1 on success, 0 where not supported


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    prompt_lengths: torch.Tensor  # [B]
    response_mask: torch.Tensor  # [B, R] 1 = generated token in the loss
    response_valid: torch.Tensor  # [B, R] 1 = a response token (generated or observation)
    token_level_rewards: torch.Tensor  # [B, R]
    index: np.ndarray  # group ids
    rollout_index: np.ndarray  # rollout ids (group statistics are taken over rollouts)
    engine_logprobs: torch.Tensor  # [B, R] the behaviour policy's log-probs (0 where missing)
    has_engine: torch.Tensor  # [B] 1 where the sample carries the engine's log-probs


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
    engine = torch.zeros((n, resp_width))
    has_engine = torch.zeros(n)
    for i, (s, row) in enumerate(zip(samples, rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        r = len(s.response_ids)
        response_mask[i, :r] = torch.tensor(s.response_mask, dtype=torch.float32)
        response_valid[i, :r] = 1
        if r:  # the scalar reward at the last response token (token_rewards are credited values, not summable)
            rewards[i, r - 1] = float(s.reward or 0.0)
        if s.rollout_logprobs is not None and len(s.rollout_logprobs) == r:
            engine[i, :r] = torch.tensor(s.rollout_logprobs)
            has_engine[i] = 1
    index = np.array(group_keys(samples), dtype=object)
    rollout_index = np.array([s.rollout_id or str(i) for i, s in enumerate(samples)], dtype=object)
    return Batch(input_ids, attention, torch.tensor([len(s.prompt_ids) for s in samples]), response_mask,
                 response_valid, rewards, index, rollout_index, engine, has_engine)


class LocalBackend:
    """Holds the PEFT model: one LoRA adapter per policy (served name) on the one base model (PEFT
    multi-adapter), each with its own optimizer and config (``LocalConfig.for_policy``).
    ``update(samples, policy=name)`` trains that adapter only, and ``adapter(name)`` is what its
    publisher saves. One policy is one named adapter (``policies=("policy",)``, the default); where
    the backend holds one, ``policy`` may be left out."""

    def __init__(self, model_dir: str | Path, config: LocalConfig | None = None, *, seed: int = 0,
                 device: str | None = None, policies: Sequence[str] = ("policy",)) -> None:
        try:
            import peft
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise ImportError("the local trainer needs peft: pip install 'lightning-rl[local]'") from exc
        self.config = config or LocalConfig()
        if isinstance(policies, str) or not policies or len(set(policies)) != len(policies):
            raise ConfigurationError(f"policies must be distinct served names, at least one, got {policies!r}")
        self.config.check_policies(policies)
        set_malloc_mmap_threshold(self.config.malloc_mmap_threshold)
        self._seed = seed
        torch.manual_seed(seed)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, self.config.dtype))
        self.base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
        self.pad_token_id = AutoTokenizer.from_pretrained(str(model_dir)).pad_token_id or 0
        lora = peft.LoraConfig(r=self.config.lora_rank, lora_alpha=self.config.lora_alpha, lora_dropout=0.0,
                               target_modules=list(self.config.target_modules))
        # PEFT adapter names are module keys: policy i is "policy{i}" inside, its served name outside
        self._adapters: dict[str, str] = {name: f"policy{i}" for i, name in enumerate(policies)}
        names = list(self._adapters.values())
        self.model = peft.get_peft_model(base, lora, adapter_name=names[0])
        for name in names[1:]:
            self.model.add_adapter(name, lora)
        self.model = self.model.to(self.device)
        self.model.train()
        self._configs = {policy: self.config.for_policy(policy) for policy in self._adapters}
        self._optimizers = {
            policy: torch.optim.AdamW(self._params(name), lr=self._configs[policy].lr, weight_decay=0.0)
            for policy, name in self._adapters.items()}

    @property
    def policies(self) -> list[str]:
        return list(self._adapters)

    def _params(self, adapter: str) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if "lora_" in n and f".{adapter}." in n]

    def _policy(self, policy: str | None) -> str:
        """``policy``, or the only one the backend holds when it is None."""
        if policy is None:
            if len(self._adapters) > 1:
                raise ConfigurationError(f"this backend holds {len(self._adapters)} policies; name the one to use "
                                         f"(policy=..., one of {self.policies})")
            return next(iter(self._adapters))
        if policy not in self._adapters:
            known = ", ".join(repr(p) for p in self._adapters)
            raise ConfigurationError(f"no adapter for policy {policy!r}; this backend holds {known}")
        return policy

    def _use(self, policy: str | None) -> str:
        policy = self._policy(policy)
        name = self._adapters[policy]
        if self.model.active_adapter != name:
            self.model.set_adapter(name)  # only this adapter is active and trainable
        return policy

    def adapter(self, policy: str | None = None) -> "AdapterWeights":
        """The weights a publisher saves for ``policy`` (its adapter alone, as a PEFT adapter folder)."""
        return AdapterWeights(self.model, self._adapters[self._policy(policy)])

    def memory(self) -> dict[str, Any]:
        """Bytes held in this process: the base model once, and per policy its adapter and optimizer state."""
        out: dict[str, Any] = {"base_mb": self.base_bytes / 2**20, "policies": {}}
        for policy, name in self._adapters.items():
            params = self._params(name)
            state = self._optimizers[policy].state
            adapter = sum(p.numel() * p.element_size() for p in params)
            optimizer = sum(t.numel() * t.element_size() for p in params for t in state.get(p, {}).values()
                            if isinstance(t, torch.Tensor))
            out["policies"][policy] = {"adapter_mb": adapter / 2**20, "optimizer_mb": optimizer / 2**20}
        return out

    def response_logprobs(self, batch: Batch, rows: slice, temperature: float | None = None) -> torch.Tensor:
        """[b, R] log-probs of the response tokens of ``batch[rows]`` under the current model (the active
        adapter), at ``temperature`` (default: the config's)."""
        ids = batch.input_ids[rows].to(self.device)
        mask = batch.attention_mask[rows].to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits / (temperature or self.config.temperature)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        width = batch.response_mask.shape[1]
        out = torch.zeros((ids.shape[0], width), device=self.device)
        for i, start in enumerate(batch.prompt_lengths[rows].tolist()):
            length = int(batch.response_valid[rows][i].sum().item())
            out[i, :length] = logp[i, start - 1: start - 1 + length]
        return out

    def _all_logprobs(self, batch: Batch, cfg: LocalConfig) -> torch.Tensor:
        step = cfg.micro_batch_size
        return torch.cat([self.response_logprobs(batch, slice(i, i + step), cfg.temperature)
                          for i in range(0, len(batch.index), step)])

    def update(self, samples: list[Sample], policy: str | None = None) -> dict[str, float]:
        """One batch of updates to ``policy``'s adapter (may be left out where the backend holds one), with
        that policy's config (``LocalConfig.for_policy``), as it was when the backend was built."""
        policy = self._use(policy)
        stats = self._update(samples, policy, self._configs[policy])
        trim = self.config.malloc_trim
        if trim or (trim is None and len(self._adapters) > 1):  # the update's activations are freed now
            release_freed_memory()
        return stats

    def _update(self, samples: list[Sample], policy: str, cfg: LocalConfig) -> dict[str, float]:
        optimizer = self._optimizers[policy]
        batch = build_batch(samples, self.pad_token_id)
        mask = batch.response_mask.to(self.device)
        with torch.no_grad():
            old = self._all_logprobs(batch, cfg)  # the proximal policy: once per batch
            ref = None
            if cfg.kl_coef:
                with self.model.disable_adapter():
                    ref = self._all_logprobs(batch, cfg)
        advantages, _ = get_adv_estimator(cfg.adv_estimator)(
            batch.token_level_rewards.to(self.device), mask, batch.index, rollout_index=batch.rollout_index,
            **cfg.adv_kwargs)
        policy_loss = get_policy_loss(cfg.policy_loss)
        stats: dict[str, float] = {}
        engine = batch.engine_logprobs.to(self.device)
        has_engine = batch.has_engine.to(self.device).unsqueeze(-1)
        weights = None
        if cfg.rollout_is and bool(batch.has_engine.any()):
            weights, is_stats = rollout_is_weights(old, engine, mask * has_engine, cfg.rollout_is_threshold)
            weights = torch.where(has_engine.bool(), weights, mask)  # no behaviour log-probs: weight 1
            stats.update(is_stats)
        n = len(samples)
        order = torch.Generator().manual_seed(self._seed)
        steps = 0
        sums: dict[str, float] = {}
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(n, generator=order).tolist()
            for start in range(0, n, cfg.mini_batch_size):
                mini = perm[start:start + cfg.mini_batch_size]
                optimizer.zero_grad(set_to_none=True)
                for m in range(0, len(mini), cfg.micro_batch_size):
                    rows = mini[m:m + cfg.micro_batch_size]
                    log_prob = self.response_logprobs(batch, rows, cfg.temperature)
                    loss, pg = policy_loss(old[rows], log_prob, advantages[rows], mask[rows],
                                                loss_agg_mode=cfg.loss_agg_mode, clip_ratio=cfg.clip_ratio,
                                                rollout_is_weights=None if weights is None else weights[rows])
                    if ref is not None:
                        kl = agg_loss(kl_penalty(log_prob, ref[rows], cfg.kl_kind), mask[rows], cfg.loss_agg_mode)
                        loss = loss + cfg.kl_coef * kl
                        pg["kl"] = kl.item()
                    share = len(rows) / len(mini)
                    (loss * share).backward()
                    pg["loss"] = loss.item()
                    for key, value in pg.items():
                        sums[key] = sums.get(key, 0.0) + value * share
                grad_norm = torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], cfg.max_grad_norm)
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm)
                optimizer.step()
                steps += 1
        stats.update({key: value / steps for key, value in sums.items()})  # means over optimizer steps
        rewards = batch.token_level_rewards.sum(-1)
        stats.update({
            "samples": float(n),
            "optimizer_steps": float(steps),
            "lr": float(optimizer.param_groups[0]["lr"]),
            "reward_mean": rewards.mean().item(),
            "advantage_abs_mean": masked_mean(advantages.abs(), mask).item(),
            "response_tokens_mean": batch.response_valid.sum(-1).mean().item(),
            "samples_without_engine_logprobs": float(n - batch.has_engine.sum().item()),
        })
        if bool(batch.has_engine.any()):
            # proximal (the trainer, start of the batch) against behaviour (the engine): the same weights
            # when on-policy, so this is the numeric gap between the two; off-policy it grows with staleness
            gap = masked_mean((engine - old).abs(), mask * has_engine).item()
            stats["engine_logprob_gap"] = gap if math.isfinite(gap) else float("nan")
        return stats


    def sft(self, samples: list[Sample], *, epochs: int = 1, lr: float | None = None,
            policy: str | None = None) -> dict[str, float]:
        """Supervised fine-tuning of ``policy``'s adapter on ``samples``: the mean negative log-likelihood
        of their trained response tokens (``response_mask``), at temperature 1, in mini-batches of the
        config's size, with an optimizer of its own (the RL optimizer's state starts clean after it).
        Returns the mean loss of the first and of the last epoch, and the counts."""
        if not samples:
            raise ConfigurationError("sft needs at least one sample")
        check_int(epochs, "epochs", minimum=1)
        policy = self._use(policy)
        cfg = self._configs[policy]
        params = self._params(self._adapters[policy])
        optimizer = torch.optim.AdamW(params, lr=lr if lr is not None else cfg.lr, weight_decay=0.0)
        batch = build_batch(samples, self.pad_token_id)
        mask = batch.response_mask.to(self.device)
        order = torch.Generator().manual_seed(self._seed)
        losses: list[float] = []
        steps = 0
        for _ in range(epochs):
            perm = torch.randperm(len(samples), generator=order).tolist()
            total, count = 0.0, 0
            for start in range(0, len(perm), cfg.mini_batch_size):
                mini = perm[start:start + cfg.mini_batch_size]
                tokens = float(mask[mini].sum().item()) or 1.0
                optimizer.zero_grad(set_to_none=True)
                for m in range(0, len(mini), cfg.micro_batch_size):
                    rows = mini[m:m + cfg.micro_batch_size]
                    log_prob = self.response_logprobs(batch, rows, 1.0)
                    nll = -(log_prob * mask[rows]).sum() / tokens  # token mean over the mini-batch
                    nll.backward()
                    total += nll.item() * tokens
                    count += int(mask[rows].sum().item())
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                steps += 1
            losses.append(total / max(1, count))
        return {"sft_loss_first_epoch": losses[0], "sft_loss_last_epoch": losses[-1], "sft_epochs": float(epochs),
                "sft_optimizer_steps": float(steps), "sft_samples": float(len(samples)),
                "sft_tokens": float(mask.sum().item())}


def load_adapter(backend: LocalBackend, path: str | Path, policy: str | None = None) -> None:
    """Set ``policy``'s adapter to the weights saved in ``path`` (an adapter folder with the same LoRA setup)."""
    import peft

    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise ConfigurationError(f"init_adapter {str(path)!r} is not a LoRA adapter folder (no adapter_config.json)")
    name = backend.adapter(policy).name
    weights = peft.load_peft_weights(str(path), device=str(backend.device))
    result = peft.set_peft_model_state_dict(backend.model, weights, adapter_name=name)
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{name}." in k]
    if missing:
        raise ConfigurationError(f"init_adapter {str(path)!r} does not fit this LoRA setup ({len(missing)} weights "
                                 f"missing, e.g. {missing[0]}); train it with the same LocalConfig (rank, targets)")


class AdapterWeights:
    """One adapter of a multi-adapter PEFT model, saved as a plain PEFT adapter folder
    (``adapter_config.json`` and ``adapter_model.safetensors``: what vLLM's LoRA loader reads)."""

    def __init__(self, model: Any, adapter: str) -> None:
        self.model, self.name = model, adapter

    def save_pretrained(self, path: str | Path) -> None:
        import peft
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = peft.get_peft_model_state_dict(self.model, adapter_name=self.name)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
                  str(path / "adapter_model.safetensors"))
        self.model.peft_config[self.name].save_pretrained(str(path))
