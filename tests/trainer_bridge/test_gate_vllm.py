"""The gate before going live, on a real vLLM server with real LoRA hot-loading: a candidate is served
under its own name, evaluated beside the live policy, and refused or promoted."""

from __future__ import annotations

import json

import openai
import peft
import pytest
import torch

import lightning_rl as lrl
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.continuous import ContinuousTrainer

from ..conftest import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _production_agent(vllm_url):
    """A production agent: it calls the live name and returns no reward (feedback comes later)."""
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace(mode="prod")
    def production_agent(question):
        r = client.chat.completions.create(model="policy", max_tokens=4,
                                           messages=[{"role": "user", "content": question}])
        return r.choices[0].message.content

    return production_agent


def _weights(backend):
    return {k: v.clone() for k, v in peft.get_peft_model_state_dict(
        backend.model, adapter_name=backend.adapter().name).items()}


def test_a_worse_candidate_is_refused_and_an_equal_one_promoted(traced, vllm_url, tmp_path):
    production_agent = _production_agent(vllm_url)
    answered: list[str] = []  # the served name each gate call was answered by
    candidate_reward = {"value": 0.0}

    @lrl.trace
    def gate_agent(task):
        base_url, model = lrl.current_endpoint()
        r = openai.OpenAI(base_url=base_url, api_key="EMPTY").chat.completions.create(
            model=model, max_tokens=2, temperature=0, messages=[{"role": "user", "content": task}])
        # the live policy: sent as its version's own name (replicas.py), answered as asked
        answered.append(r.model)
        lrl.emit_reward(1.0 if r.model == "policy" else candidate_reward["value"])

    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                out_dir=tmp_path / "ct", min_new=2, max_policy_lag=2,
                                local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2),
                                gate_tasks=["a", "b", "c"], gate_agent=gate_agent, gate_margin=0.1)

    def traffic(k):
        for i in range(2):
            production_agent(f"What is {k}+{i}?")
        for r in traced.rollouts(mode="prod", newest_first=True, limit=2):
            traced.add_reward(r.rollout_id, float(k % 2))

    try:
        trainer.start()
        live = _weights(trainer.backend)
        traffic(1)
        update = trainer.step()  # the candidate scores 0 where live scores 1: refused
        assert sorted(answered) == ["policy"] * 3 + ["policy-candidate"] * 3  # served under its own name
        assert update["gate_decision"] == "refused" and update["gate_promoted"] == 0
        assert update["candidate_version"] == 1 and update["version"] == 0 and trainer.version == 0
        assert (update["gate_n_candidate"], update["gate_mean_candidate"], update["gate_mean_live"]) == (3, 0.0, 1.0)
        assert update["gate_lower_bound"] == -1.0 and not update["gate_not_worse"]
        assert [p.version for p in traced.policies("policy")] == [0]  # nothing published
        decided = traced.decisions("policy")  # the decision, with its figures, beside the publishes
        assert [(d.version, d.decision, d.live_version) for d in decided] == [(1, "evaluated", 0), (1, "refused", 0)]
        assert decided[1].figures["gate_lower_bound"] == -1.0 and decided[1].figures["gate_promoted"] == 0
        assert decided[1].adapter == update["candidate_adapter"] and "< -margin" in decided[1].reason
        assert (tmp_path / "ct" / "candidates" / "v00001.1" / "adapter_config.json").is_file()  # kept on disk
        assert not (tmp_path / "ct" / "adapters" / "v00001").exists()
        after = _weights(trainer.backend)
        assert all(torch.equal(live[k], after[k]) for k in live)  # training goes on from the live weights
        assert trainer.step() is None  # the refused batch is used, not trained on again
        assert all(r.mode == "eval" for r in traced.rollouts() if r.rollout_id.startswith("gate-"))

        candidate_reward["value"] = 1.0
        answered.clear()
        traffic(2)
        update = trainer.step()  # equal on every task: promoted, the live figure of version 0 reused
        assert answered == ["policy-candidate"] * 3
        assert update["gate_decision"] == "promoted" and update["gate_lower_bound"] == 0.0
        assert update["candidate_version"] == 1 and update["version"] == 1 and trainer.version == 1
        assert [p.version for p in traced.policies("policy")] == [0, 1]
        assert [(d.version, d.decision) for d in traced.decisions("policy")][2:] == [(1, "evaluated"), (1, "promoted")]
        assert traced.decisions("policy")[-1].figures["gate_mean_candidate"] == 1.0
        assert (tmp_path / "ct" / "candidates" / "v00001.2").is_dir()
        lines = (tmp_path / "ct" / "metrics.jsonl").read_text().splitlines()
        assert [x.count('"gate_decision"') for x in lines] == [1, 1]
    finally:
        trainer.close()
        tracing.versions.forget("policy")


def test_a_rollback_by_hand_is_served_recorded_and_followed_by_the_running_trainer(traced, vllm_url, tmp_path):
    from click.testing import CliRunner

    from lightning_rl.cli import main
    from lightning_rl.trainer_bridge.local import load_adapter

    production_agent = _production_agent(vllm_url)

    def traffic(k):
        for i in range(2):
            production_agent(f"What is {k}+{i}?")
        for j, r in enumerate(traced.rollouts(mode="prod", newest_first=True, limit=2)):
            traced.add_reward(r.rollout_id, float(j))

    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                out_dir=tmp_path / "ct", min_new=2, max_policy_lag=2,
                                local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2))
    try:
        trainer.start()
        first = _weights(trainer.backend)
        for k in (1, 2):
            traffic(k)
            assert trainer.step()["version"] == k
        assert not all(torch.equal(first[k], v) for k, v in _weights(trainer.backend).items())
        done = CliRunner().invoke(main, ["policies", "rollback", "--to", "0", "--store", traced.url, "--server-url",
                                         vllm_url, "--reason", "a bad update"])
        assert done.exit_code == 0, done.output
        assert '"version": 0' in done.output
        assert [p.version for p in traced.policies("policy")] == [0, 1, 2, 0]  # the latest publish: version 0
        rolled = traced.decisions("policy")
        assert [(d.version, d.decision, d.live_version, d.reason) for d in rolled] == [
            (0, "rolled_back", 2, "a bad update")]
        assert rolled[0].adapter == str((tmp_path / "ct" / "adapters" / "v00000").resolve())
        assert trainer.step() is None  # its next step follows the store: version 0, with its weights
        assert trainer.version == 0
        last = json.loads((tmp_path / "ct" / "metrics.jsonl").read_text().splitlines()[-1])
        assert (last["version"], last["rolled_back"], last["rolled_back_from"]) == (0, 1, 2)
        assert all(torch.equal(first[k], v) for k, v in _weights(trainer.backend).items())
        traffic(3)  # served by version 0 again
        assert {r.policy_version for r in traced.rollouts(mode="prod", newest_first=True, limit=2)} == {0}
        update = trainer.step()
        assert update["version"] == 3 and update["rollouts"] == 2  # past every version the name had
        assert [p.version for p in traced.policies("policy")] == [0, 1, 2, 0, 3]
        load_adapter(trainer.backend, tmp_path / "ct" / "adapters" / "v00000")  # the folder rolled back to is intact
    finally:
        trainer.close()
        tracing.versions.forget("policy")


def test_the_rollback_watch_restores_the_previous_version_when_production_reward_drops(traced, vllm_url, tmp_path):
    production_agent = _production_agent(vllm_url)

    def traffic(k, rewards):
        for i in range(len(rewards)):
            production_agent(f"What is {k}+{i}?")
        for r, value in zip(traced.rollouts(mode="prod", newest_first=True, limit=len(rewards)), rewards):
            traced.add_reward(r.rollout_id, value)

    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                                out_dir=tmp_path / "ct", min_new=3, max_policy_lag=2,
                                local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2),
                                rollback_watch=True, watch_min_rollouts=2)
    try:
        trainer.start()
        first = _weights(trainer.backend)
        traffic(1, [1.0, 1.0, 1.0])  # served by version 0
        assert trainer.step()["version"] == 1
        traffic(2, [1.0, 0.0])  # served by version 1: not shown worse yet (upper bound -0.5 + 3.08 * 0.5)
        assert trainer.step() is None and trainer.version == 1 and traced.decisions() == []
        traffic(3, [0.0, 0.0, 0.0])  # version 1's reward drops: 1/5 against 3/3 (upper bound -0.8 + 1.53 * 0.2)
        assert trainer.step() is None  # rolled back instead of updating
        assert trainer.version == 0 and [p.version for p in traced.policies("policy")] == [0, 1, 0]
        decided = traced.decisions("policy")
        assert [(d.version, d.decision, d.live_version) for d in decided] == [(0, "rolled_back", 1)]
        assert decided[0].reason.startswith("watch: production reward of version 1 0.2000 (n=5) against 1.0000 (n=3)")
        assert decided[0].figures["watch_worse"] is True and decided[0].figures["watch_upper_bound"] < -0.1
        assert all(torch.equal(first[k], v) for k, v in _weights(trainer.backend).items())
        assert trainer.step() is None and trainer.last_check["waiting"] == 0  # the dropped batch is not trained on
        lines = [json.loads(x) for x in (tmp_path / "ct" / "metrics.jsonl").read_text().splitlines()]
        assert [(x["version"], x.get("rolled_back")) for x in lines] == [(1, None), (0, 1)]  # in the metrics line too
        assert lines[1]["rolled_back_from"] == 1 and lines[1]["watch_upper_bound"] < -0.1
    finally:
        trainer.close()
        tracing.versions.forget("policy")


def test_the_gate_runs_async_agents_and_scores_failed_or_hung_tries_zero(traced, vllm_url):
    import asyncio
    import threading
    import time

    from lightning_rl.trainer_bridge.gate import Gate

    from ..conftest import SERVED_NAME

    client = openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace
    async def async_agent(task):
        base_url, model = lrl.current_endpoint()
        r = await client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                                 messages=[{"role": "user", "content": task}])
        if task == "fail":
            raise ValueError("the agent gave up")
        lrl.emit_reward(0.5 if r.model == SERVED_NAME else 0.0)

    gate = Gate(traced, async_agent, ["a", "fail", "b"], server_url=vllm_url, served_name=SERVED_NAME, n=2)
    try:
        assert sorted(gate.rewards(SERVED_NAME)) == [0.0, 0.0, 0.5, 0.5, 0.5, 0.5]
        assert {r.mode for r in traced.rollouts() if r.rollout_id.startswith("gate-")} == {"eval"}
    finally:
        gate.close()
    release = threading.Event()

    @lrl.trace
    def hung_agent(task):
        if task == "hang":
            release.wait(30)
        lrl.emit_reward(1.0)

    gate = Gate(traced, hung_agent, ["ok", "hang"], server_url=vllm_url, served_name=SERVED_NAME, timeout=1.0)
    began = time.monotonic()
    try:
        assert sorted(gate.rewards(SERVED_NAME)) == [0.0, 1.0]  # the hung try is not waited for past its time
        assert time.monotonic() - began < 10
    finally:
        release.set()
        gate.close()
    assert asyncio.iscoroutinefunction(async_agent)
