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
