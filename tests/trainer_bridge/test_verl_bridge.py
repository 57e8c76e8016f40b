"""Samples from stored trajectories into verl's DataProto, checked against verl's own math (CPU)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import lightning_rl as lrl
from lightning_rl.records import Reward, RewardSource, RolloutStatus, Sample
from lightning_rl.store import SQLiteStore, trajectory_samples

from ..store.helpers import llm_span, rollout

pytestmark = pytest.mark.verl
verl_bridge = pytest.importorskip("lightning_rl.trainer_bridge.verl")
pytest.importorskip("verl")
from verl.trainer.ppo import core_algos  # noqa: E402

PAD = 0


def test_golden_batch_for_one_trajectory():
    sample = Sample(rollout_id="r", group_id="g", agent_name="solver", policy_version=3,
                    prompt_ids=[11, 12, 13], response_ids=[21, 22, 7, 8, 23],  # 7, 8: a tool result
                    response_mask=[1, 1, 0, 0, 1], rollout_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], reward=1.0)
    batch = verl_bridge.to_dataproto([sample], pad_token_id=PAD, max_prompt_length=5, max_response_length=7,
                                     temperature=0.7)
    t = batch.batch
    assert t["prompts"].tolist() == [[0, 0, 11, 12, 13]]
    assert t["responses"].tolist() == [[21, 22, 7, 8, 23, 0, 0]]
    assert t["input_ids"].tolist() == [[0, 0, 11, 12, 13, 21, 22, 7, 8, 23, 0, 0]]
    assert t["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]]
    assert t["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 7, 7]]
    assert t["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0, 0]]
    assert torch.allclose(t["rollout_log_probs"], torch.tensor([[-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, 0.0]]))
    assert t["rm_scores"].tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    nt = batch.non_tensor_batch
    assert list(nt["uid"]) == ["g"] and list(nt["agent_name"]) == ["solver"] and list(nt["policy_version"]) == [3]
    assert list(nt["multi_modal_inputs"]) == [{}]
    assert batch.meta_info["temperature"] == 0.7


def _stored_team(tmp_path):
    store = SQLiteStore(tmp_path / "runs.db")
    for k, (rid, reward) in enumerate([("a1", 1.0), ("a2", 0.0), ("b1", 0.5)]):
        store.start_rollout(rollout(rid, group_id="ga" if rid.startswith("a") else "gb"))
        store.add_spans([
            llm_span(rid, 0, 0, [1, 2, 3], [4, 5], agent="solver"),
            llm_span(rid, 1, 1, [1, 2, 3, 4, 5, 9, 9], [6, 7, 8], agent="solver"),  # 9 9: tool result
            llm_span(rid, 2, 2, [1, 2, 50], [51], agent="checker"),
        ])
        store.write_reward(Reward(rollout_id=rid, value=reward, source=RewardSource.RETURNED))
        store.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)
    store.flush()
    return store


def test_stored_multi_turn_multi_agent_batches_through_verl_math(tmp_path):
    store = _stored_team(tmp_path)
    samples = []
    for t in lrl.trajectories(store):
        samples += trajectory_samples(t, level="trajectory", agents=["solver"])[0]
    batch = verl_bridge.to_dataproto(samples, pad_token_id=PAD, max_prompt_length=4, max_response_length=8)
    t = batch.batch
    assert t["responses"].shape == (3, 8) and set(batch.non_tensor_batch["agent_name"]) == {"solver"}
    assert t["response_mask"][0].tolist() == [1, 1, 0, 0, 1, 1, 1, 0]
    last = t["attention_mask"][:, 4:].sum(-1) - 1
    assert last.tolist() == [6, 6, 6] and t["rm_scores"][:, 6].tolist() == [1.0, 0.0, 0.5]
    # one scalar per sample (a shared reward is not counted once per merged call)
    assert t["rm_scores"].sum(-1).tolist() == [1.0, 0.0, 0.5]
    # verl's own estimator, loss and aggregation on our batch
    adv, _ = core_algos.compute_grpo_outcome_advantage(t["rm_scores"], t["response_mask"].float(),
                                                       batch.non_tensor_batch["uid"])
    a_scores = torch.tensor([1.0, 0.0])
    expected_a = (a_scores - a_scores.mean()) / (a_scores.std() + 1e-6)
    assert torch.allclose(adv[:2, 0], expected_a, atol=1e-5) and adv[2, 0].item() == pytest.approx(0.5)
    assert torch.equal(adv * (1 - t["response_mask"].float()), torch.zeros_like(adv))  # tool tokens carry nothing
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    old = t["rollout_log_probs"]
    loss = core_algos.compute_policy_loss_vanilla(old, old.clone(), adv, t["response_mask"].float(),
                                                  loss_agg_mode="token-mean", config=config)[0]
    expected = core_algos.agg_loss(loss_mat=-adv, loss_mask=t["response_mask"].float(), loss_agg_mode="token-mean")
    assert torch.allclose(loss, expected, atol=1e-6)  # ratio 1: the loss is -mean(advantage) over generated tokens
    store.close()


def test_length_rule_drops_long_prompts_and_truncates_long_responses():
    ok = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], response_mask=[1, 1, 1, 1], reward=1.0, group_id="g")
    long_prompt = Sample(prompt_ids=[1] * 9, response_ids=[3], response_mask=[1], reward=1.0, group_id="g")
    batch = verl_bridge.to_dataproto([ok, long_prompt], pad_token_id=PAD, max_prompt_length=4, max_response_length=3)
    assert batch.meta_info["lightning_rl_metrics"] == {"samples_in": 2, "dropped_long_prompt": 1,
                                                       "dropped_empty_response": 0, "truncated_response": 1,
                                                       "samples_out": 1}
    assert batch.batch["responses"].tolist() == [[3, 4, 5]] and batch.batch["rm_scores"].tolist() == [[0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="no sample fits"):
        verl_bridge.to_dataproto([long_prompt], pad_token_id=PAD, max_prompt_length=4, max_response_length=3)


def test_batches_concatenate_and_split_like_verl_batches():
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3, i], response_mask=[1, 1], reward=float(i), group_id=f"g{i % 2}")
               for i in range(4)]
    batch = verl_bridge.to_dataproto(samples, pad_token_id=PAD, max_prompt_length=3, max_response_length=3)
    halves = batch.chunk(2)
    assert len(halves) == 2 and len(halves[0]) == 2
    from verl import DataProto

    again = DataProto.concat(halves)
    assert torch.equal(again.batch["input_ids"], batch.batch["input_ids"])
    assert list(again.non_tensor_batch["uid"]) == ["g0", "g1", "g0", "g1"]
    assert isinstance(batch.non_tensor_batch["uid"], np.ndarray)


def test_a_team_gives_one_batch_per_policy_and_each_goes_through_verls_grpo():
    def sample(group, policy, reward, agent):
        return Sample(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 1], reward=reward, group_id=group,
                      policy=policy, agent_name=agent, rollout_id=f"{group}-{policy}-{reward}")

    samples = [sample("g1", "planner-lora", 1.0, "planner"), sample("g1", "planner-lora", 0.0, "planner"),
               sample("g1", "solver-lora", 1.0, "solver"), sample("g1", "solver-lora", 1.0, "solver"),
               sample("g1", "tiny", 1.0, "solver")]
    mixed = verl_bridge.to_dataproto(samples[:4], pad_token_id=PAD, max_prompt_length=3, max_response_length=3)
    assert list(mixed.non_tensor_batch["uid"]) == ["g1|policy=planner-lora"] * 2 + ["g1|policy=solver-lora"] * 2
    assert list(mixed.non_tensor_batch["policy"]) == ["planner-lora"] * 2 + ["solver-lora"] * 2
    batches = verl_bridge.to_dataprotos(samples, policies=["planner-lora", "solver-lora", "critic-lora"],
                                        pad_token_id=PAD, max_prompt_length=3, max_response_length=3)
    assert sorted(batches) == ["planner-lora", "solver-lora"]  # a policy with no samples gets no batch
    for name, batch in batches.items():
        assert set(batch.non_tensor_batch["policy"]) == {name} and len(batch) == 2
        assert batch.meta_info["lightning_rl_metrics"]["samples_unrouted"] == 1  # the call to "tiny"
        assert list(batch.non_tensor_batch["uid"]) == ["g1", "g1"]
    t = batches["planner-lora"].batch
    adv, _ = core_algos.compute_grpo_outcome_advantage(t["rm_scores"], t["response_mask"].float(),
                                                       batches["planner-lora"].non_tensor_batch["uid"])
    assert adv[0, 0] > 0 > adv[1, 0]  # planners compared with planners
    t = batches["solver-lora"].batch
    adv, _ = core_algos.compute_grpo_outcome_advantage(t["rm_scores"], t["response_mask"].float(),
                                                       batches["solver-lora"].non_tensor_batch["uid"])
    assert torch.equal(adv, torch.zeros_like(adv))  # two equal solver tries: nothing to learn, whatever planners got
