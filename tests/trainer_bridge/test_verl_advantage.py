"""lightning-rl's advantage in verl's trainer (``verl/advantage.py``): the failure rule, each segment's own reward, a
masked last segment, verl's padding rows. Checked against verl's own GRPO where verl is installed (the ``verl``
suite) and by hand here."""

from __future__ import annotations

import pytest
import torch

from lightning_rl.trainer_bridge.verl.advantage import RowPlan, plan_rows, row_advantages


def _plan(key: str, reward: float, failure: str = "", padding: bool = False) -> RowPlan:
    (plan,) = plan_rows([key], [{"is_padding": padding}], [{"segment_reward": reward, "failure": failure}], [0.0])
    return plan


def _grpo(scores: list[float]) -> list[float]:
    t = torch.tensor(scores)
    return ((t - t.mean()) / (t.std() + 1e-6)).tolist()


def test_a_group_with_an_infrastructure_failure_leaves_the_batch_and_the_others_are_unchanged():
    good = [_plan("g1_0_0", 1.0), _plan("g1_1_0", 0.0), _plan("g1_2_0", 0.0)]
    bad = [_plan("g2_0_0", 1.0), _plan("g2_1_0", 0.0, failure="infra"), _plan("g2_2_0", 1.0)]
    mask = torch.ones(6, 3)
    advantages, kept, counts = row_advantages(good + bad, mask)
    assert kept.tolist() == [True] * 3 + [False] * 3
    assert advantages[3:].abs().sum() == 0  # no gradient from the failed group, its rows not in any statistics
    alone, _, _ = row_advantages(good, torch.ones(3, 3))
    assert torch.equal(advantages[:3], alone)  # the other group's advantages: those of the batch without it
    assert advantages[:3, 0].tolist() == pytest.approx(_grpo([1.0, 0.0, 0.0]), abs=1e-5)
    assert counts.as_metrics() == {"model_failures": 0, "infra_failures": 1, "groups_dropped_infra": 1,
                                   "tries_dropped_infra": 3}


def test_each_segment_keeps_its_own_reward_against_its_groups_tries():
    """Credit that gives segments different rewards reaches the loss: the group's mean and std are over its tries
    (one score per try: the mean of its rows), each row's advantage is its own reward against them, as the local
    trainer's GRPO (``algorithms.grpo_outcome_advantage`` with ``rollout_index``)."""
    plans = [_plan("g_0_0", 0.25), _plan("g_0_1", 1.0), _plan("g_1_0", 0.0), _plan("g_2_0", 0.5)]
    advantages, _, _ = row_advantages(plans, torch.ones(4, 2))
    tries = torch.tensor([0.625, 0.0, 0.5])
    mean, std = tries.mean(), tries.std()
    expected = [(r - mean) / (std + 1e-6) for r in (0.25, 1.0, 0.0, 0.5)]
    assert advantages[:, 0].tolist() == pytest.approx([float(e) for e in expected], abs=1e-5)
    assert advantages[0, 0] != advantages[1, 0]  # verl alone gives both segments the last one's advantage


def test_a_masked_last_segment_leaves_the_tries_other_segments_their_gradient():
    """verl reads a try's advantage from its last row at its first unmasked token: a fully masked last row gave
    every segment of the try advantage 0 while its reward still counted. Here the masked row's reward counts for
    its try, its tokens get nothing, the try's first segment keeps its advantage."""
    plans = [_plan("g_0_0", 1.0), _plan("g_0_1", 1.0), _plan("g_1_0", 0.0)]
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    advantages, kept, _ = row_advantages(plans, mask)
    assert kept.all()
    assert advantages[0, 0] > 0 and advantages[0, 2] == 0 and advantages[1].abs().sum() == 0
    assert advantages[2, 0] < 0 and advantages[0, 0] == pytest.approx(-advantages[2, 0])


def test_verls_padding_rows_and_a_model_failure():
    """Padding rows (verl's, a uid of their own, fields copied from a real row) get nothing and are not counted; a
    try the model made fail is trained on with its failure reward."""
    plans = [_plan("g_0_0", 1.0), _plan("g_1_0", -0.5, failure="model"),
             _plan("padabc_0_0", 0.0, failure="infra", padding=True)]
    advantages, kept, counts = row_advantages(plans, torch.ones(3, 2))
    assert kept.tolist() == [True, True, False] and advantages[2].abs().sum() == 0
    assert advantages[1, 0] < 0 < advantages[0, 0]
    assert counts.as_metrics() == {"model_failures": 1, "infra_failures": 0, "groups_dropped_infra": 0,
                                   "tries_dropped_infra": 0}


def test_a_row_our_loop_did_not_make_is_scored_by_verls_own_reward():
    (plan,) = plan_rows(["u_0_0"], [{}], [None], [0.75])
    assert (plan.group, plan.session, plan.reward, plan.failure) == ("u", "u_0", 0.75, "")


def test_the_served_logprob_gap_and_its_limit():
    from lightning_rl.trainer_bridge.verl.gap import gap_limit, logprob_gap

    engine = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -9.0, 0.0]])
    actor = torch.tensor([[-1.1, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # only the trained tokens: the untrained 2.5 and 8.0 are not read
    gap = logprob_gap(engine, actor, mask, limit=0.05)
    assert gap["lightning_rl/served_logprob_gap_max"] == pytest.approx(0.1)
    assert gap["lightning_rl/served_logprob_gap_mean"] == pytest.approx(0.1 / 3)
    assert gap["lightning_rl/served_logprob_gap_over"] == 1
    assert logprob_gap(engine, actor, torch.zeros_like(mask), limit=0.05)["lightning_rl/served_logprob_gap_max"] == 0
    assert gap_limit({"rollout_is_threshold": 2.0}) == pytest.approx(0.6931, abs=1e-4)  # verl's config reads alike
    assert gap_limit({"rollout_is_threshold": 4.0}) == pytest.approx(1.3863, abs=1e-4)
    assert gap_limit(None) == gap_limit({}) == gap_limit({"rollout_is_threshold": "bad"}) == pytest.approx(0.6931,
                                                                                                         abs=1e-4)
