"""The canary before going live, on a real vLLM server with real LoRA hot-loading: the candidate serves a
share of production rollouts under its own name (routed by @trace), and is refused or promoted on their
production reward."""

from __future__ import annotations

import time

import openai
import pytest
import torch

import lightning_rl as lrl
from lightning_rl.tracer import tracing
from lightning_rl.tracer.canary import canaries_from
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.continuous import ContinuousTrainer
from lightning_rl.trainer_bridge.rollback import rollback

from ..conftest import ensure_tiny_model
from .test_gate_vllm import _production_agent, _weights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _batch(store, production_agent, k, rewards=None):
    """Two rewarded production rollouts (the next candidate's batch), never ones a canary in progress takes."""
    route = canaries_from(store.latest_decisions()).get("policy")
    ids = [rid for rid in (f"batch-{k}-{j}" for j in range(64)) if route is None or not route.routes(rid)][:2]
    for rid, reward in zip(ids, rewards or [float(k % 2)] * 2):
        with lrl.rollout_overrides(rollout_id=rid):
            production_agent(f"What is {k}+{k}?")
        store.add_reward(rid, reward)


def _answered_by(store, rollout_id):
    (call,) = lrl.trajectory(store, rollout_id).llm_calls
    return call.model, store.get_rollout(rollout_id).policy_version


def test_a_canary_routes_its_share_by_rollout_id_and_is_refused_or_promoted_on_production_reward(
        traced, vllm_url, tmp_path):
    production_agent = _production_agent(vllm_url)
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace(mode="eval")
    def eval_agent(question):
        return client.chat.completions.create(model="policy", max_tokens=2, messages=[
            {"role": "user", "content": question}]).model

    def batch(k):
        _batch(traced, production_agent, k)

    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                out_dir=tmp_path / "ct", min_new=2, max_policy_lag=2,
                                local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2),
                                canary=0.5, canary_min_rollouts=4)
    try:
        trainer.start()
        live = _weights(trainer.backend)
        batch(1)
        started = trainer.step()  # the candidate goes on canary, not live
        assert (started["candidate_version"], started["version"], trainer.version) == (1, 0, 0)
        assert "canary_decision" not in started
        (canary,) = [d for d in traced.decisions("policy") if d.decision == "canary"]
        assert (canary.version, canary.live_version, canary.figures["canary_name"], canary.figures["canary_share"]) \
            == (1, 0, "policy-candidate", 0.5)
        assert canary.figures["canary_until"] > time.time() + 600
        assert [p.version for p in traced.policies("policy")] == [0]
        assert not (tmp_path / "ct" / "metrics.jsonl").exists()  # the update's line waits for the decision
        route = canaries_from(traced.latest_decisions())["policy"]
        tracing.reset_policy_versions()  # this process reads the canary now, not at its next refresh

        ids = [f"canary-a-{i}" for i in range(12)]
        routed = [rid for rid in ids if route.routes(rid)]
        assert 2 <= len(routed) <= 10  # the share is drawn from the id: the same every run
        for rid in ids:
            with lrl.rollout_overrides(rollout_id=rid):
                production_agent("What is 2+2?")
        for rid in ids:  # the call went where the id says, and was recorded as sent, with its version
            assert _answered_by(traced, rid) == (("policy-candidate", 1) if rid in routed else ("policy", 0)), rid
        assert eval_agent("What is 1+1?") == "policy"  # only production is routed (the live one, answered as asked)
        assert trainer.step() is None  # no feedback yet: the canary waits, and no batch is taken
        for rid in ids:  # the candidate does worse in production than the live policy
            traced.add_reward(rid, 0.0 if rid in routed else 1.0)
        batch(3)  # rewarded rollouts wait meanwhile, for the next candidate
        refused = trainer.step()
        assert refused["canary_decision"] == "refused" and refused["canary_promoted"] == 0
        assert (refused["canary_n_candidate"], refused["canary_mean_candidate"], refused["canary_mean_live"]) == (
            len(routed), 0.0, 1.0)
        assert refused["canary_lower_bound"] == -1.0 and refused["version"] == 0
        assert trainer.last_check["canary"] == len(routed)  # its rollouts are never trained on
        assert [p.version for p in traced.policies("policy")] == [0]
        decided = traced.decisions("policy")
        assert [(d.version, d.decision) for d in decided] == [(1, "canary"), (1, "refused")]
        assert decided[-1].figures["canary_mean_candidate"] == 0.0 and "< -margin" in decided[-1].reason
        assert all(torch.equal(live[k], v) for k, v in _weights(trainer.backend).items())  # back to the live weights
        tracing.reset_policy_versions()
        after = next(rid for rid in (f"canary-c-{i}" for i in range(64)) if route.routes(rid))
        with lrl.rollout_overrides(rollout_id=after):  # the canary is over: nobody is routed
            production_agent("What is 2+2?")
        assert _answered_by(traced, after) == ("policy", 0)

        assert trainer.step()["candidate_version"] == 1  # the waiting batch: the next candidate, on canary
        tracing.reset_policy_versions()
        route = canaries_from(traced.latest_decisions())["policy"]
        ids = [f"canary-b-{i}" for i in range(16)]
        for rid in ids:
            with lrl.rollout_overrides(rollout_id=rid):
                production_agent("What is 3+3?")
            traced.add_reward(rid, 1.0)  # as good as the live policy
        assert sum(route.routes(rid) for rid in ids) >= 4
        promoted = trainer.step()
        assert promoted["canary_decision"] == "promoted" and promoted["version"] == 1 and trainer.version == 1
        assert promoted["canary_lower_bound"] == 0.0
        assert [p.version for p in traced.policies("policy")] == [0, 1]
        assert [d.decision for d in traced.decisions("policy")][-2:] == ["canary", "promoted"]
        lines = (tmp_path / "ct" / "metrics.jsonl").read_text().splitlines()
        assert [x.count('"canary_decision"') for x in lines] == [1, 1]
        tracing.reset_policy_versions()
        with lrl.rollout_overrides(rollout_id="after-promotion"):
            production_agent("What is 4+4?")
        assert _answered_by(traced, "after-promotion") == ("policy", 1)
    finally:
        trainer.close()
        tracing.versions.forget("policy")


def test_a_canary_without_enough_feedback_is_refused_and_a_stopped_trainer_ends_its_canary(traced, vllm_url, tmp_path):
    production_agent = _production_agent(vllm_url)

    def batch(k):
        _batch(traced, production_agent, k)

    def make():
        return ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                 out_dir=tmp_path / "ct", min_new=2, max_policy_lag=2,
                                 local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2),
                                 canary=0.2, canary_min_rollouts=4, canary_timeout=0.5)

    trainer = make()
    try:
        trainer.start()
        batch(1)
        assert trainer.step()["candidate_version"] == 1
        time.sleep(0.6)
        refused = trainer.step()  # no evidence in time: no promotion
        assert refused["canary_decision"] == "refused" and "canary_n_candidate" not in refused
        (decided,) = [d for d in traced.decisions("policy") if d.decision == "refused"]
        assert decided.reason.startswith("refused: only 0 rewarded canary rollout(s) (of 4) and 0 live one(s) in")
        _batch(traced, production_agent, 2, rewards=[1.0, 0.0])  # rewards that differ: the update moves the weights
        assert trainer.step()["candidate_version"] == 1  # on canary
        candidate = _weights(trainer.backend)
        rollback(traced, to=0, server_url=vllm_url, reason="by hand, mid-canary")
        ended = trainer.step()  # an operator acted on the served name: the canary ends
        assert ended["canary_decision"] == "refused" and trainer.version == 0
        assert [d.decision for d in traced.decisions("policy")][-2:] == ["rolled_back", "refused"]
        assert traced.decisions("policy")[-1].reason == (
            "refused: a rolled_back decision about 'policy' was recorded during the canary")
        assert not all(torch.equal(candidate[k], v) for k, v in _weights(trainer.backend).items())  # live's now
        batch(3)
        assert trainer.step()["candidate_version"] == 1  # on canary again
    finally:
        trainer.close()  # stopped mid-canary: ended, so that no process routes to it any longer
    assert [d.decision for d in traced.decisions("policy")][-1] == "refused"
    assert traced.decisions("policy")[-1].reason == "refused: the trainer stopped before the canary was judged"

    traced.record_decision("policy", 1, "canary", live_version=0, figures={  # as a killed trainer leaves it
        "canary_name": "policy-candidate", "canary_share": 0.2, "canary_until": time.time() + 600})
    again = make()
    try:
        again.start()
        last = traced.decisions("policy")[-1]
        assert (last.decision, last.version) == ("refused", 1) and "a trainer started again ended it" in last.reason
    finally:
        again.close()
        tracing.versions.forget("policy")
