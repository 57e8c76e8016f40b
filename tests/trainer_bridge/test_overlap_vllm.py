"""Overlapped training on the real vLLM server: updates while rollouts run, bounded staleness, replay."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl.cli import main as cli
from lightning_rl.tracer import current_rollout, tracing
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.trainer import Trainer

from ..conftest import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("peft")


def _two_call_agent(client: openai.AsyncOpenAI, store, straggle_until: int):
    """Two model calls with a tool's wait between them; the first group queued is a straggler: its tool returns
    once version ``straggle_until`` is published (a fixed 12 s once saw one update only, on a loaded machine)."""
    first_group: list[str] = []

    async def published(version: int) -> None:
        deadline = asyncio.get_running_loop().time() + 300  # a hang guard
        while max((p.version for p in store.policies("policy")), default=-1) < version:
            assert asyncio.get_running_loop().time() < deadline, f"version {version} was never published"
            await asyncio.sleep(0.1)

    @lrl.trace
    async def agent(task):
        state = current_rollout()
        if not first_group:
            first_group.append(state.group_id)
        messages = [{"role": "user", "content": f"What is {task['a']}+{task['b']}?"}]
        r = await client.chat.completions.create(model="policy", max_tokens=4, temperature=1.0, messages=messages)
        if state.group_id == first_group[0]:  # the tool
            await published(straggle_until)
        else:
            await asyncio.sleep(0.3)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": "Sure?"}]
        r = await client.chat.completions.create(model="policy", max_tokens=4, temperature=1.0, messages=messages)
        return float(state.attempt % 2)  # the tries of a group differ, so every group has an advantage

    return agent


def test_overlapped_fit_bounds_staleness_and_a_replay_repeats_its_losses(traced, vllm_url, tmp_path):
    client = openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY")
    tasks = [{"a": 20 + i, "b": 30 + i} for i in range(6)]
    config = dict(model_dir=ensure_tiny_model(), n=2, tasks_per_step=2, steps=4, local=LocalConfig(lr=1e-3), seed=3)
    trainer = Trainer(agent=_two_call_agent(client, traced, straggle_until=2), tasks=tasks, store=traced,
                      server_url=vllm_url, out_dir=tmp_path / "live", overlap=True, max_staleness=1, progress=False,
                      concurrency=16, **config)
    try:
        result = trainer.fit()
    finally:
        tracing.versions.forget("policy")
    train = [x for x in result.history if "train_reward" in x]
    assert [x["policy_version"] for x in train] == [1, 2, 3, 4]
    behind: dict[str, int] = {}
    for line in train:
        for lag, count in line["staleness"].items():
            behind[lag] = behind.get(lag, 0) + count
        assert {"idle_s", "update_s", "rollouts_per_s", "groups_in_flight", "rollout_is_max"} <= set(line)
    # all 8 groups were queued by the second publish; step 2 trains on groups queued at version 0
    assert behind.get("1", 0) > 0
    # the straggler (first group, in its tool until version 2) completes after 2+ updates: its calls at version 0 are
    # dropped
    assert sum(x["samples_dropped_stale"] for x in train) >= 2 and any(int(lag) >= 2 for lag in behind)
    assert max(x["groups_in_flight"] for x in train) > 0  # rollouts were running during updates
    off = [x for x in train if x["staleness"].get("1")]
    assert all(x["engine_logprob_gap"] > 1e-5 for x in off)  # behaviour (engine) != proximal for stale samples
    # a rollout that ran through publishes: its spans say which version served each call
    straggler = min(lrl.trajectories(traced, mode="train"), key=lambda t: t.start_time)
    first, second = (c.policy_version for c in straggler.llm_calls)
    assert first == 0 and second >= 2
    publishes = traced.policies("policy")
    assert [p.version for p in publishes] == [0, 1, 2, 3, 4]
    assert publishes[0].trained_on is None and all(len(p.trained_on) == 2 for p in publishes[1:])
    assert len({g for p in publishes[1:] for g in p.trained_on}) == 8  # every group trained on once

    # replay: the same store, seed and settings give the same loss sequence, running nothing
    out = tmp_path / "replay"
    run = CliRunner().invoke(cli, ["train", "replay", f"sqlite:///{traced.path}", "--model-dir",
                                   str(config["model_dir"]), "--lr", "1e-3", "--seed", "3", "--max-staleness", "1",
                                   "--out", str(out)], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    replayed = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [x["samples_dropped_stale"] for x in replayed] == [x["samples_dropped_stale"] for x in train]
    assert [x["loss"] for x in replayed] == pytest.approx([x["loss"] for x in train], abs=1e-6)
    assert (out / "adapters" / "v00004").is_dir()

