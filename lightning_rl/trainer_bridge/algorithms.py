"""Advantages and policy loss: the same math as verl's ``trainer/ppo/core_algos.py``.

Shapes follow verl: ``token_level_rewards``, ``response_mask``, ``log_prob``, ``old_log_prob`` and
``advantages`` are ``[batch, response_length]``; ``index`` is a numpy array of group ids (verl's
``uid``). ``tests/trainer_bridge/test_algorithms.py`` checks these against verl's own functions
on the same tensors when verl is installed, and against hand-computed values always.

Registries (plain dicts behind decorators, as in verl): advantage estimators (``grpo``,
``batch_baseline`` for traffic without groups) and policy losses (``vanilla``: PPO-clip with dual
clip, times optional truncated importance weights). Unknown names fail listing the known ones.
An estimator that compares the tries of one task declares it, ``@register_adv_estimator("grpo",
needs_groups=True)``: a trainer then refuses ``n < 2`` for it, whoever registered it (``needs_groups``).

Estimators take an optional ``rollout_index`` (the rollout of each sample): group statistics are then
taken over rollouts, one score each (the mean of its samples' scores), not over samples, so a rollout
with many LLM calls does not weigh more than one with few. With one sample per rollout this is
verl's math exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError
from ..registry import Registry
from .config import LOSS_AGG_MODES

ADV_ESTIMATORS: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = Registry(
    "advantage estimator", hint="or register one with @register_adv_estimator", traits={"needs_groups": False})
POLICY_LOSSES: Registry[Callable[..., tuple[torch.Tensor, dict[str, float]]]] = Registry(
    "policy loss", hint="or register one with @register_policy_loss")
register_adv_estimator = ADV_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register
get_adv_estimator = ADV_ESTIMATORS.get
get_policy_loss = POLICY_LOSSES.get


def needs_groups(estimator: str) -> bool:
    """Whether the estimator registered as ``estimator`` compares the tries of one task (registered with
    ``needs_groups=True``), so that a group of one try cannot train; an unknown name raises, listing the known."""
    return bool(ADV_ESTIMATORS.trait(estimator, "needs_groups"))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def _per_rollout(scores: torch.Tensor, keys: np.ndarray, rollout_index: np.ndarray | None) -> dict[Any, list[torch.Tensor]]:
    """Scores by key (group), one per rollout and key when ``rollout_index`` is given (the mean of
    that rollout's samples in the group: a team's rollout counts once for each policy's group)."""
    by_key: dict[Any, list[torch.Tensor]] = defaultdict(list)
    if rollout_index is None:
        for i in range(scores.shape[0]):
            by_key[keys[i]].append(scores[i])
        return by_key
    per_rollout: dict[tuple[Any, Any], list[torch.Tensor]] = defaultdict(list)
    for i in range(scores.shape[0]):
        per_rollout[(keys[i], rollout_index[i])].append(scores[i])
    for (key, _), values in per_rollout.items():
        by_key[key].append(torch.stack(values).mean())
    return by_key


@register_adv_estimator("grpo", needs_groups=True)
def grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                           epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True,
                           rollout_index: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage. A group of one gets mean 0 and std 1 (its raw score), as in verl."""
    scores = token_level_rewards.sum(dim=-1)
    mean, std = {}, {}
    for group, values in _per_rollout(scores, index, rollout_index).items():
        if len(values) == 1:
            mean[group], std[group] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(values)
            mean[group], std[group] = stacked.mean(), stacked.std()
    out = scores.clone()
    for i in range(scores.shape[0]):
        centered = scores[i] - mean[index[i]]
        out[i] = centered / (std[index[i]] + epsilon) if norm_adv_by_std_in_grpo else centered
    out = out.unsqueeze(-1) * response_mask
    return out, out


@register_adv_estimator("batch_baseline")
def batch_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray | None = None,
                             epsilon: float = 1e-6, baseline: float | None = None,
                             rollout_index: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For traffic without groups (continuous mode): score minus a baseline (the batch mean unless
    given, e.g. a running mean), divided by the batch std. Needs no repeated prompts."""
    scores = token_level_rewards.sum(dim=-1)
    values = torch.stack(_per_rollout(scores, np.zeros(scores.shape[0]), rollout_index)[0.0]) if scores.numel() else scores
    center = torch.tensor(baseline) if baseline is not None else values.mean()
    scale = values.std() if values.numel() > 1 else torch.tensor(1.0)
    out = ((scores - center) / (scale + epsilon)).unsqueeze(-1) * response_mask
    return out, out


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       threshold: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level truncated importance weights min(exp(log p_old - log p_rollout), threshold): the
    proximal policy over the behaviour policy that sampled the tokens (the engine's log-probs). Zero on
    masked tokens. verl's ``compute_rollout_correction_weights(rollout_is="token")``."""
    log_ratio = torch.clamp(old_log_prob - rollout_log_prob, min=-20.0, max=20.0)
    raw = torch.exp(log_ratio) * response_mask
    weights = raw.clamp(max=threshold)
    on = response_mask.bool()
    return weights, {"rollout_is_mean": masked_mean(raw, response_mask).item(),
                     "rollout_is_max": raw[on].max().item() if bool(on.any()) else 0.0,
                     "rollout_is_truncated_frac": masked_mean((raw > threshold).float(), response_mask).item()}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        seq = torch.sum(loss_mat * loss_mask, dim=-1)
        return torch.mean(seq)
    if loss_agg_mode == "seq-mean-token-mean":
        seq = torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1).clamp(min=1)
        return torch.mean(seq)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq = torch.sum(loss_mat * loss_mask, dim=-1)
        return torch.sum(seq) / loss_mask.shape[-1]
    raise ConfigurationError(f"loss_agg_mode {loss_agg_mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")


@register_policy_loss("vanilla")
def ppo_clip_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", clip_ratio: float = 0.2,
                  clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
                  clip_ratio_c: float = 3.0, rollout_is_weights: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped objective with dual clip for negative advantages, each token's loss times its
    importance weight when given (verl's ``compute_policy_loss_vanilla``)."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clipped1 = torch.maximum(losses1, losses2)
    clipfrac = masked_mean(torch.gt(losses2, losses1).float(), response_mask)
    losses3 = -advantages * clip_ratio_c
    clipped2 = torch.min(losses3, clipped1)
    clipfrac_lower = masked_mean(torch.gt(clipped1, losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clipped2, clipped1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return loss, {"pg_clipfrac": clipfrac.item(), "ppo_kl": ppo_kl.item(), "pg_clipfrac_lower": clipfrac_lower.item()}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate to the reference policy (verl's ``kl_penalty``: kl/k1, abs, mse/k2, low_var_kl/k3)."""
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise ConfigurationError(f"kl penalty {kind!r} is not one of kl, abs, mse, low_var_kl")
