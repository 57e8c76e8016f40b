"""Trainer.fit end to end on the real vLLM server: groups, updates, hot-swaps, metrics, plot."""

from __future__ import annotations

import json

import openai
import pytest

import lightning_rl as lrl
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.local import LocalConfig
from lightning_rl.trainer_bridge.trainer import Trainer

from ..conftest import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("peft")


def test_fit_two_steps(traced, vllm_url, tmp_path):
    client = openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace
    async def agent(task):
        if task["a"] == 13:
            raise ConnectionError("simulated model failure")  # a failed rollout: never trained on
        r = await client.chat.completions.create(model="policy", max_tokens=6, temperature=1.0,
                                                 messages=[{"role": "user", "content": f"What is {task['a']}+{task['b']}?"}])
        return 1.0 if r.choices[0].message.content.strip() == str(task["a"] + task["b"]) else 0.0

    tasks = [{"a": 13, "b": 1}] + [{"a": 20 + i, "b": 30 + i} for i in range(5)]
    trainer = Trainer(agent=agent, tasks=tasks, store=traced, model_dir=ensure_tiny_model(),
                      server_url=vllm_url, out_dir=tmp_path, n=3, tasks_per_step=3, steps=2,
                      eval_tasks=tasks[1:3], local=LocalConfig(lr=1e-3), progress=False, seed=1)
    try:
        result = trainer.fit()
    finally:
        tracing._policy_versions.pop("policy", None)
    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    train = [x for x in lines if "train_reward" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["policy_version"] == x["step"] for x in train)
    # the engine served the weights the trainer computed its proximal log-probs with (processed log-probs)
    assert all(x["optimizer_steps"] >= 1 and x["engine_logprob_gap"] < 1e-3 for x in train)
    evals = [x for x in lines if "eval_success" in x]
    assert [x["eval_success"] for x in evals] == [result.eval_before, result.eval_after]
    assert result.plot_path.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "adapters" / "v00002").is_dir()
    # spans record which policy version served them; failed rollouts are counted, kept, not trained on
    versions = {c.policy_version for t in traced.trajectories(mode="train") for c in t.llm_calls}
    assert versions == {0, 1}  # step 1 ran on version 0, step 2 on version 1
    assert {r.policy_version for r in traced.rollouts(mode="train")} == {0, 1}
    assert [p.version for p in traced.policies("policy")] == [0, 1, 2]
    failed = traced.rollouts(status="failed")
    outcomes = {}
    for x in train:
        for key, value in x["outcomes"].items():
            outcomes[key] = outcomes.get(key, 0) + value
    assert outcomes.get("failed", 0) > 0  # the failing task was drawn (seed 1)
    assert outcomes["failed"] == len([r for r in failed if r.mode == "train"])
