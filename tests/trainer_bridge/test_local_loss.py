"""The local backend's update on the project's tiny model (no server): the proximal policy is fixed for
the batch, mini-batches move the current one away from it, and the metrics show it."""

from __future__ import annotations

import random

import pytest

from lightning_rl.records import Sample

from ..conftest import ensure_tiny_model

pytest.importorskip("peft")


def _samples(n: int = 64, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(Sample(prompt_ids=[rng.randrange(5, 90) for _ in range(12)],
                          response_ids=[rng.randrange(5, 90) for _ in range(6)], response_mask=[1] * 6,
                          reward=float(rng.random() < 0.5), group_id=f"g{i // 8}", rollout_id=f"r{i}",
                          rollout_logprobs=[-4.0] * 6))
    return out


def _update(**config):
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend

    backend = LocalBackend(ensure_tiny_model(), LocalConfig(**{"lr": 5e-3, **config}), seed=0, device="cpu")
    return backend.update(_samples())


def test_mini_batches_move_the_policy_away_from_the_proximal_one():
    stats = _update()  # defaults: 64 samples, mini-batches of 16: 4 optimizer steps
    assert stats["optimizer_steps"] == 4
    assert stats["pg_clipfrac"] > 0 and stats["ppo_kl"] != 0  # the clip acts from the second step on
    assert 0 < stats["rollout_is_mean"] and "engine_logprob_gap" in stats
    assert stats["samples_without_engine_logprobs"] == 0


def test_one_step_per_batch_is_on_policy_and_says_so():
    stats = _update(mini_batch_size=64)  # one step from the proximal policy: ratio 1, nothing to clip
    assert stats["optimizer_steps"] == 1 and stats["pg_clipfrac"] == 0 and stats["ppo_kl"] == 0


def test_several_epochs_clip_too():
    stats = _update(mini_batch_size=64, ppo_epochs=3)
    assert stats["optimizer_steps"] == 3 and stats["pg_clipfrac"] > 0
