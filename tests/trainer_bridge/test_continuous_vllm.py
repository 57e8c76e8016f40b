"""Continuous mode on simulated production traffic with delayed user feedback (real vLLM, real LoRA)."""

from __future__ import annotations

import openai
import pytest

import lightning_rl as lrl
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.continuous import ContinuousTrainer
from lightning_rl.trainer_bridge.config import LocalConfig

from ..conftest import SERVED_NAME, ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("peft")


def test_trains_on_late_feedback_and_drops_stale_rollouts(traced, vllm_url, tmp_path):
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace(mode="prod")
    def production_agent(question):  # returns no reward: feedback comes later
        r = client.chat.completions.create(model="policy", max_tokens=8,
                                           messages=[{"role": "user", "content": question}])
        return r.choices[0].message.content

    assembled = []
    real_rollout_data = traced.rollout_data

    def counting_rollout_data(rollout_ids):
        assembled.extend(rollout_ids)
        return real_rollout_data(rollout_ids)

    traced.rollout_data = counting_rollout_data  # how much each check reads (what trajectory() reads through)
    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                out_dir=tmp_path / "ct", min_new=4, max_policy_lag=0,
                                local=LocalConfig(adv_estimator="batch_baseline", lr=1e-3))
    try:
        trainer.start()
        assert trainer.version == 0
        old = [production_agent(f"What is {10 + i}+{20 + i}?") for i in range(6)]
        assert len(old) == 6
        ids = [r.rollout_id for r in traced.rollouts(mode="prod")]
        assert trainer.step() is None  # traffic without feedback is not trained on
        assert assembled == [] and trainer.last_check["assembled"] == 0  # nor read
        assert trainer.step() is None and assembled == []
        for rid, value in zip(ids[:3], (1.0, 0.0, 1.0)):
            traced.add_reward(rid, value, name="reward")  # user feedback, after the rollouts ended
        assert trainer.step() is None  # 3 < min_new
        assert sorted(assembled) == sorted(ids[:3])
        assert trainer.step() is None and sorted(assembled) == sorted(ids[:3])  # kept, not read again
        traced.add_reward(ids[1], 1.0)  # the user changed their mind: the latest reward counts
        assert trainer.step() is None and sorted(assembled) == sorted([*ids[:3], ids[1]])
        assert trainer.source.waiting[ids[1]].final_reward == 1.0
        traced.add_reward(ids[3], 0.0)
        update = trainer.step()
        assert update is not None and update["rollouts"] == 4 and trainer.version == 1
        assert sorted(assembled) == sorted([*ids[:4], ids[1]])
        assert {"prefix_splits", "calls_without_engine_ids", "unrewarded_samples"} <= set(update)
        assert traced.policies("policy")[-1].version == 1  # the publish is recorded in the store
        assert (tmp_path / "ct" / "adapters" / "v00001").is_dir()
        # feedback for a rollout served by version 0 arrives now: too stale with max_policy_lag=0
        traced.add_reward(ids[4], 1.0)
        new = [production_agent(f"What is {30 + i}+{40 + i}?") for i in range(4)]
        assert len(new) == 4
        new_ids = [r.rollout_id for r in traced.rollouts(mode="prod", newest_first=True, limit=4)]
        for rid in new_ids:
            traced.add_reward(rid, 1.0)
        assert {c.policy_version for rid in new_ids for c in lrl.trajectory(traced, rid).llm_calls} == {1}
        assert {traced.get_rollout(rid).policy_version for rid in new_ids} == {1}
        assert {t.rollout_id for t in lrl.trajectories(traced, mode="prod", min_policy_version=1)} == set(new_ids)
        update = trainer.step()
        assert update["rollouts"] == 4 and update["dropped_stale"] == 1 and trainer.version == 2
        # with max_policy_lag=0 nothing served before version 2 can be trained on: the state forgets it
        assert trainer.state["used"] == {} and trainer.state["dropped"] == {}
        traced.add_reward(new_ids[0], 0.0)  # so a used rollout rewarded again is too stale, not trained twice
        assert trainer.step() is None and trainer.last_check["dropped_stale"] == 1
        # a restarted trainer resumes (same version, nothing trained twice)
        again = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                  out_dir=tmp_path / "ct", min_new=1, max_policy_lag=0)
        again.start()
        assert again.version == 2 and again.step() is None
    finally:
        tracing.versions.forget("policy")


def test_trains_only_on_calls_the_trainer_can_reproduce(traced, vllm_url, tmp_path):
    """Log-probs are computed at the trainer's temperature, with no top-p/top-k, for the served
    policy: production calls sampled otherwise, or answered by another model, are not trained on."""
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace(mode="prod")
    def production_agent(question, model="policy", **sampling):
        r = client.chat.completions.create(model=model, max_tokens=8, messages=[{"role": "user", "content": question}],
                                           **sampling)
        return r.choices[0].message.content

    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                out_dir=tmp_path / "ct", min_new=2, max_policy_lag=5,
                                local=LocalConfig(adv_estimator="batch_baseline", lr=1e-3, temperature=0.7))
    calls = {
        "hot": dict(temperature=1.0),  # another temperature
        "default": {},  # no temperature: the API's default, 1.0
        "top_p": dict(temperature=0.7, top_p=0.5),  # truncated sampling the trainer does not reproduce
        "base": dict(temperature=0.7, model=SERVED_NAME),  # the base model, not the trained LoRA
        "ok1": dict(temperature=0.7),
        "ok2": dict(temperature=0.7, top_p=1.0),  # an explicit no-op is fine
    }
    try:
        trainer.start()
        for rid, kwargs in calls.items():
            with lrl.rollout_overrides(rollout_id=rid):
                production_agent(f"What is 12+{len(rid)}?", **kwargs)
        assert lrl.trajectory(traced, "hot").llm_calls[0].sampling_params["temperature"] == 1.0
        for value, rid in enumerate(calls):
            traced.add_reward(rid, float(value % 2))
        update = trainer.step()
        assert trainer.last_check["other_sampling"] == 3 and trainer.last_check["other_model"] == 1
        assert trainer.last_check["without_samples"] == 4 and trainer.last_check["waiting"] == 2
        assert update is not None and update["rollouts"] == 2 and update["samples"] == 2
        assert update["skipped_other_sampling"] == 3 and update["skipped_other_model"] == 1
        assert set(trainer.state["used"]) == {"ok1", "ok2"}
        assert trainer.step() is None and trainer.last_check["other_sampling"] == 0  # not read again
    finally:
        tracing.versions.forget("policy")
