"""Agents that are commands (lrl.command): a Node.js agent with the official openai npm package, and
Python command-line agents, traced through the in-process gateway against the real vLLM server, and
trained by Trainer."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl.gateway import CommandFailed
from lightning_rl.records import RolloutStatus
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.local import LocalConfig
from lightning_rl.trainer_bridge.trainer import Trainer

from .conftest import SERVED_NAME, ensure_tiny_model

pytestmark = [pytest.mark.vllm]
NODE_AGENT = Path(__file__).resolve().parent.parent / "examples" / "gateway_node" / "agent.mjs"
needs_node = pytest.mark.skipif(
    shutil.which("node") is None or not (NODE_AGENT.parent / "node_modules" / "openai").is_dir(),
    reason="Node.js and the openai npm package (make node-deps)")


@needs_node
def test_a_node_agent_is_traced_with_the_engines_token_ids_and_its_printed_reward(traced, vllm_url):
    agent = lrl.command(["node", str(NODE_AGENT)], upstream=vllm_url,
                        env={"AGENT_MODEL": SERVED_NAME, "AGENT_TEMPERATURE": "0", "AGENT_SEED": "0"})
    reward = asyncio.run(agent({"a": 12, "b": 30}))
    (rollout,) = traced.rollouts()
    traj = traced.trajectory(rollout.rollout_id)
    assert traj.status == RolloutStatus.SUCCEEDED and traj.name == "agent.mjs" and traj.task == {"a": 12, "b": 30}
    (call,) = traj.llm_calls
    assert call.streamed and call.token_ids_source == "engine" and len(call.response_token_ids) >= 1
    assert len(call.response_logprobs) == len(call.response_token_ids)
    answer = call.output_messages[0]["content"]
    # whatever the model said, the agent's reward is what it printed, and it judged what was recorded
    assert reward == traj.final_reward == (1.0 if answer.strip() == "42" else 0.0)


def test_a_python_command_sends_its_reward_to_the_endpoint_and_a_failing_one_fails_its_rollout(traced, vllm_url):
    script = f"""
import json, os, sys, httpx, openai
task = json.loads(sys.stdin.read())
client = openai.OpenAI(max_retries=0)
r = client.chat.completions.create(model={SERVED_NAME!r}, max_tokens=4, temperature=0, seed=0,
                                   messages=[{{"role": "user", "content": task["q"]}}])
httpx.post(os.environ["LIGHTNING_RL_REWARDS_URL"], json={{"value": 0.25, "name": "judge"}},
           headers={{"authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}}).raise_for_status()
print("done, no number on the last line")
if task.get("crash"):
    sys.exit("boom: " + task["crash"])
"""
    agent = lrl.command([sys.executable, "-c", script], upstream=vllm_url, name="py-agent")
    assert asyncio.run(agent({"q": "What is 1+1?"})) is None
    with pytest.raises(CommandFailed, match="exited with status 1: boom: on purpose"):
        asyncio.run(agent({"q": "What is 2+2?", "crash": "on purpose"}))
    ok, failed = sorted(traced.rollouts(), key=lambda r: "crash" in r.task)
    assert ok.status == RolloutStatus.SUCCEEDED and failed.status == RolloutStatus.FAILED
    assert "boom: on purpose" in failed.error
    for r in (ok, failed):  # the call and the endpoint's reward are recorded either way
        traj = traced.trajectory(r.rollout_id, reward_name="judge")
        assert len(traj.llm_calls) == 1 and traj.llm_calls[0].token_ids_source == "engine"
        assert [(x.name, x.value, x.llm_call_index) for x in traj.rewards] == [("judge", 0.25, 0)]


def test_bad_commands_are_refused_before_any_rollout(traced):
    with pytest.raises(lrl.ConfigurationError, match="list of strings"):
        lrl.command("node agent.mjs", upstream="http://127.0.0.1:8000")
    with pytest.raises(lrl.ConfigurationError, match="http"):
        lrl.command(["node", "agent.mjs"], upstream="127.0.0.1:8000")
    assert traced.rollouts() == []


@needs_node
@pytest.mark.slow
def test_trainer_trains_a_node_agent(traced, vllm_url, tmp_path):
    """Trainer with an agent that is a command: the Node agent's calls to the served LoRA become
    samples, one update runs and its weights are published."""
    pytest.importorskip("peft")
    agent = lrl.command(["node", str(NODE_AGENT)], upstream=vllm_url, env={"AGENT_MODEL": "policy"})
    tasks = [{"a": 20 + i, "b": 30 + i} for i in range(4)]
    trainer = Trainer(agent=agent, tasks=tasks, store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                      out_dir=tmp_path, n=2, tasks_per_step=2, steps=1, local=LocalConfig(lr=1e-3), progress=False)
    try:
        result = trainer.fit()
    finally:
        tracing._policy_versions.pop("policy", None)
    (line,) = [x for x in result.history if "train_reward" in x]
    assert line["outcomes"] == {"succeeded": 4} and line["samples"] == 4 and line["policy_version"] == 1
    assert line["calls_without_engine_ids"] == 0 and line["engine_logprob_gap"] < 1e-3
    assert [p.version for p in traced.policies("policy")] == [0, 1]
