"""The local backend's batch layout (no model needed)."""

from __future__ import annotations

import torch

from lightning_rl.records import Sample
from lightning_rl.trainer_bridge.local import build_batch


def test_merged_trajectory_sample_counts_its_reward_once():
    merged = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 9, 5], response_mask=[1, 1, 0, 1], reward=1.0,
                    token_rewards=[0.0, 1.0, 0.0, 1.0], group_id="g", rollout_logprobs=[-0.1, -0.2, 0.0, -0.3])
    single = Sample(prompt_ids=[1], response_ids=[7], response_mask=[1], reward=0.0, group_id="g",
                    rollout_logprobs=[-0.5])
    batch = build_batch([merged, single], pad_token_id=0)
    assert batch.token_level_rewards.sum(-1).tolist() == [1.0, 0.0]
    assert batch.token_level_rewards[0].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert batch.response_mask.tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 9, 5], [1, 7, 0, 0, 0, 0]]
    assert batch.prompt_lengths.tolist() == [2, 1] and list(batch.index) == ["g", "g"]
    assert torch.allclose(batch.engine_logprobs[1], torch.tensor([-0.5, 0.0, 0.0, 0.0]))


def test_a_team_batch_compares_each_policy_with_itself():
    """One task group, two policies: GRPO's groups are (task group, policy), so a planner attempt is
    normalised against the other planner attempts only, never against the solver's rewards."""
    from lightning_rl.trainer_bridge.algorithms import get_adv_estimator

    def sample(policy, reward, rollout):
        return Sample(prompt_ids=[1], response_ids=[2], response_mask=[1], reward=reward, group_id="g",
                      rollout_id=rollout, policy=policy)

    samples = [sample("planner", 1.0, "r0"), sample("planner", 0.0, "r1"),
               sample("solver", 1.0, "r0"), sample("solver", 1.0, "r1")]
    batch = build_batch(samples, pad_token_id=0)
    assert list(batch.index) == ["g|policy=planner"] * 2 + ["g|policy=solver"] * 2
    advantages, _ = get_adv_estimator("grpo")(batch.token_level_rewards, batch.response_mask, batch.index,
                                              rollout_index=batch.rollout_index)
    planner, solver = advantages[:2, 0], advantages[2:, 0]
    assert planner[0] > 0 > planner[1]  # the planners differ: one is better than the other
    assert solver.abs().max() < 1e-6  # both solvers got 1.0: nothing to learn between them
    single = build_batch([sample("policy", 1.0, "r0"), sample("policy", 0.0, "r1")], pad_token_id=0)
    assert list(single.index) == ["g", "g"]  # one policy: the groups are the task groups, as before
