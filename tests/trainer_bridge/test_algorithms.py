"""Advantage and loss math: hand-computed values, and verl's own functions when verl is installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_rl as lrl
from lightning_rl.trainer_bridge.algorithms import (
    agg_loss,
    get_adv_estimator,
    get_policy_loss,
    grpo_outcome_advantage,
    kl_penalty,
    ppo_clip_loss,
    rollout_is_weights,
)


def _batch():
    torch.manual_seed(0)
    rewards = torch.zeros(6, 5)
    lengths = [5, 3, 4, 2, 5, 1]
    mask = torch.zeros(6, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        rewards[i, n - 1] = [1.0, 0.0, 1.0, 0.0, 0.5, 1.0][i]  # reward at the last response token
    index = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    log_prob = torch.randn(6, 5) * 0.1 - 1.0
    old_log_prob = log_prob + torch.randn(6, 5) * 0.3
    return rewards, mask, index, log_prob, old_log_prob


def test_grpo_by_hand():
    rewards, mask, index, *_ = _batch()
    adv, returns = grpo_outcome_advantage(rewards, mask, index)
    a = torch.tensor([1.0, 0.0, 1.0])
    expected_a = (a - a.mean()) / (a.std() + 1e-6)
    b = torch.tensor([0.0, 0.5])
    expected_b = (b - b.mean()) / (b.std() + 1e-6)
    expected = torch.cat([expected_a, expected_b, torch.tensor([1.0])])  # a group of one keeps its raw score
    assert torch.allclose(adv[:, 0] * mask[:, 0], expected * mask[:, 0], atol=1e-6)
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv)) and torch.equal(adv, returns)


def test_ppo_clip_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.9, 0.2]]))  # ratios 1.8 and 0.4
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, stats = ppo_clip_loss(old, new, adv, mask, clip_ratio=0.2)
    # token 1: A>0, ratio 1.8 clipped to 1.2 -> -1.2 ; token 2: A<0, ratio 0.4 -> max(0.4, 0.8)=0.8 -> dual clip min(3, 0.8)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-5)
    assert stats["pg_clipfrac"] == pytest.approx(1.0)


def test_agg_modes_and_kl():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(lp, ref, "kl").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(np.exp(-0.5) + 0.5 - 1, abs=1e-6)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(loss, mask, "median")


def test_unknown_names_list_known():
    with pytest.raises(lrl.UnknownNameError, match="grpo"):
        get_adv_estimator("gae2")
    with pytest.raises(lrl.UnknownNameError, match="vanilla"):
        get_policy_loss("magic")


@pytest.mark.verl
def test_equal_to_verl_core_algos():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    rewards, mask, index, log_prob, old_log_prob = _batch()
    ours, _ = grpo_outcome_advantage(rewards, mask, index)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    assert torch.allclose(ours, theirs, atol=1e-6)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert torch.allclose(agg_loss(ours, mask, mode), core_algos.agg_loss(loss_mat=ours, loss_mask=mask, loss_agg_mode=mode))
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    their_loss = core_algos.compute_policy_loss_vanilla(old_log_prob, log_prob, ours, mask, loss_agg_mode="token-mean", config=config)
    our_loss, _ = ppo_clip_loss(old_log_prob, log_prob, ours, mask, clip_ratio=config.clip_ratio, clip_ratio_c=config.clip_ratio_c)
    assert torch.allclose(our_loss, their_loss[0], atol=1e-6)
    for kind in ("kl", "abs", "mse", "low_var_kl"):
        assert torch.allclose(kl_penalty(log_prob, old_log_prob, kind), core_algos.kl_penalty(log_prob, old_log_prob, kind))


def test_truncated_importance_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.3]]))
    engine = torch.log(torch.tensor([[0.5, 0.3, 0.6]]))  # ratios 1.0, 3.0 (truncated to 2.0), 0.5
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    weights, stats = rollout_is_weights(old, engine, mask, threshold=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 0.5]]), atol=1e-6)
    assert stats["rollout_is_truncated_frac"] == pytest.approx(1 / 3)
    assert stats["rollout_is_max"] == pytest.approx(3.0)  # before truncation
    assert stats["rollout_is_mean"] == pytest.approx((1.0 + 3.0 + 0.5) / 3)
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    weighted, _ = ppo_clip_loss(old, old, adv, mask, rollout_is_weights=weights)  # ratio 1: loss = -mean(w * A)
    assert weighted.item() == pytest.approx(-(1.0 + 2.0 + 0.5) / 3, abs=1e-6)


def test_group_statistics_are_taken_over_rollouts_not_calls():
    # group "g": rollout r1 has 3 calls with reward 1, rollout r2 one call with reward 0
    rewards = torch.tensor([[1.0], [1.0], [1.0], [0.0]])
    mask = torch.ones(4, 1)
    index = np.array(["g"] * 4, dtype=object)
    rollouts = np.array(["r1", "r1", "r1", "r2"], dtype=object)
    adv, _ = grpo_outcome_advantage(rewards, mask, index, rollout_index=rollouts)
    two = torch.tensor([1.0, 0.0])
    expected = (two - two.mean()) / (two.std() + 1e-6)  # one score per rollout: +0.707 / -0.707
    assert torch.allclose(adv[:, 0], torch.tensor([expected[0]] * 3 + [expected[1]]), atol=1e-5)
    by_call, _ = grpo_outcome_advantage(rewards, mask, index)  # the old way: the 3-call rollout dominates
    assert not torch.allclose(by_call, adv)
    baseline, _ = get_adv_estimator("batch_baseline")(rewards, mask, index, rollout_index=rollouts)
    assert torch.allclose(baseline[:, 0], adv[:, 0], atol=1e-5)


@pytest.mark.verl
def test_importance_weights_and_weighted_loss_equal_verl():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.workers.config import ActorConfig

    rewards, mask, index, log_prob, old_log_prob = _batch()
    engine = old_log_prob + torch.randn(old_log_prob.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    ours_w, _ = rollout_is_weights(old_log_prob, engine, mask, threshold=2.0)
    theirs_w, _ = compute_rollout_correction_weights(old_log_prob - engine, mask, rollout_is="token",
                                                     rollout_is_threshold=2.0)
    assert torch.allclose(ours_w, theirs_w, atol=1e-6) and (ours_w == 2.0).any()  # some weights were truncated
    adv, _ = grpo_outcome_advantage(rewards, mask, index)
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    theirs = core_algos.compute_policy_loss_vanilla(old_log_prob, log_prob, adv, mask, loss_agg_mode="token-mean",
                                                    config=config, rollout_is_weights=theirs_w)
    ours, _ = ppo_clip_loss(old_log_prob, log_prob, adv, mask, clip_ratio=config.clip_ratio,
                            clip_ratio_c=config.clip_ratio_c, rollout_is_weights=ours_w)
    assert torch.allclose(ours, theirs[0], atol=1e-6)
