"""Agents that are commands (lrl.command): a Node.js agent with the official openai npm package, and
Python command-line agents, traced through the in-process gateway against the real vLLM server, and
trained by Trainer."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import CommandFailed
from lightning_rl.records import RolloutStatus
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.local import LocalConfig
from lightning_rl.trainer_bridge.trainer import Trainer

from ..conftest import SERVED_NAME, ensure_tiny_model

pytestmark = [pytest.mark.vllm]
NODE_AGENT = Path(__file__).resolve().parents[2] / "examples" / "gateway_node" / "agent.mjs"
needs_node = pytest.mark.skipif(
    shutil.which("node") is None or not (NODE_AGENT.parent / "node_modules" / "openai").is_dir(),
    reason="Node.js and the npm packages of examples/gateway_node (make node-deps)")


@needs_node
def test_a_node_agent_with_a_tool_is_traced_with_the_engines_ids_its_tool_span_and_its_reward(traced, vllm_url):
    agent = lrl.command(["node", str(NODE_AGENT)], upstream=vllm_url, env={
        "AGENT_MODEL": SERVED_NAME, "AGENT_TEMPERATURE": "0", "AGENT_SEED": "0", "AGENT_FORCE_TOOL": "1"})
    reward = asyncio.run(agent({"a": 12, "b": 30}))
    (rollout,) = traced.rollouts()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    assert traj.status == RolloutStatus.SUCCEEDED and traj.name == "agent.mjs" and traj.task == {"a": 12, "b": 30}
    first, second = traj.llm_calls  # two turns, both streamed, both with the engine's ids
    for call in (first, second):
        assert call.streamed and call.token_ids_source == "engine" and len(call.response_token_ids) >= 1
        assert len(call.response_logprobs) == len(call.response_token_ids)
    (tool_call,) = first.tool_calls
    assert tool_call.name == "calculator"
    (tool,) = traj.tool_spans
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == tool_call.id
    expression = json.loads(tool_call.arguments)["expression"]
    assert tool.attributes[semconv.TOOL_RESULT] == str(sum(map(int, expression.split("+"))))
    answer = second.output_messages[0]["content"]
    # whatever the model said, the agent's reward is what it printed, and it judged what was recorded
    assert reward == traj.final_reward == (1.0 if answer.strip() == "42" else 0.0)


@needs_node
def test_a_node_agent_sends_its_own_spans_over_otlp(traced, vllm_url):
    """The OpenTelemetry JS SDK's OTLP exporter (protobuf), configured only by the environment that
    lrl.command sets, adds the agent's own spans to its rollout, beside the call the gateway recorded."""
    agent = lrl.command(["node", str(NODE_AGENT.parent / "otlp_agent.mjs")], upstream=vllm_url,
                        env={"AGENT_MODEL": SERVED_NAME})
    assert asyncio.run(agent({"a": 12, "b": 30})) == 1.0
    (rollout,) = traced.rollouts()
    traced.flush()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    (tool,) = traj.tool_spans
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "node-call-1" and tool.attributes[semconv.TOOL_RESULT] == "42"
    spans = {s.name: s for s in traced.spans(rollout.rollout_id)}
    assert tool.parent_id == spans["plan"].span_id and spans["plan"].attributes["task.a"] == 12
    assert spans["plan"].attributes["service.name"]  # the SDK's resource, kept
    (call,) = traj.llm_calls
    assert call.token_ids_source == "engine"


def test_a_curl_agent_and_a_langchain_agent_that_never_imports_lightning_rl(traced, vllm_url):
    curl = f"""set -e
curl -sf "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" \\
  -H 'content-type: application/json' \\
  -d '{{"model": "{SERVED_NAME}", "max_tokens": 4, "temperature": 0, "messages": [{{"role": "user", "content": "Hi"}}]}}'
echo
curl -sf "$LIGHTNING_RL_REWARDS_URL" -H "Authorization: Bearer $OPENAI_API_KEY" -d '{{"value": 1.0, "name": "judge"}}'
echo
echo 0.5
"""
    assert asyncio.run(lrl.command(["bash", "-c", curl], upstream=vllm_url, name="curl-agent")({"q": "hi"})) == 0.5
    langchain = f"""
import os, sys
from langchain_openai import ChatOpenAI
llm = ChatOpenAI(model={SERVED_NAME!r}, base_url=os.environ["OPENAI_BASE_URL"], temperature=0, max_tokens=4,
                 max_retries=0)
llm.invoke("What is 1+1?")
sys.exit(3 if any(m.split(".")[0] == "lightning_rl" for m in sys.modules) else 0)
"""
    asyncio.run(lrl.command([sys.executable, "-c", langchain], upstream=vllm_url, name="langchain-agent")({"q": 1}))
    by_name = {r.name: r for r in traced.rollouts()}
    for name in ("curl-agent", "langchain-agent"):
        traj = lrl.trajectory(traced, by_name[name].rollout_id)
        assert traj.status == RolloutStatus.SUCCEEDED
        (call,) = traj.llm_calls
        assert call.token_ids_source == "engine" and call.response_token_ids
    rewards = {(r.name, r.value) for r in traced.rewards(by_name["curl-agent"].rollout_id)}
    assert rewards == {("judge", 1.0), ("reward", 0.5)}


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
        traj = lrl.trajectory(traced, r.rollout_id, reward_name="judge")
        assert len(traj.llm_calls) == 1 and traj.llm_calls[0].token_ids_source == "engine"
        assert [(x.name, x.value, x.llm_call_index) for x in traj.rewards] == [("judge", 0.25, 0)]


def test_a_command_runs_against_the_endpoint_and_sampling_its_queued_try_carries(traced, vllm_url):
    """What verl's external rollouts queue: a try with a (verl) server's endpoint and verl's sampling; a runner
    runs an agent in another language (``upstream=None``) against it, sampled at the trainer's temperature."""
    from lightning_rl.trainer_bridge.runner import Runner

    script = """
import os, openai
client = openai.OpenAI(max_retries=0)
client.chat.completions.create(model=os.environ["LIGHTNING_RL_MODEL"], max_tokens=4, temperature=0.0,
                               messages=[{"role": "user", "content": "Hi"}])
print(1.0)
"""
    agent = lrl.command([sys.executable, "-c", script], name="py-agent")
    endpoint = [vllm_url.rstrip("/").removesuffix("/v1") + "/v1", SERVED_NAME]
    (entry,) = traced.enqueue({"q": 1}, overrides={"endpoint": endpoint, "sampling": {"temperature": 0.7}})
    runner = Runner(traced, agent, rollout_timeout=120)
    try:
        runner.run_until_done([entry.group_id])
    finally:
        runner.close()
    (done,) = traced.queue_entries([entry.group_id])
    traj = lrl.trajectory(traced, done.rollout_id)
    assert traj.status == RolloutStatus.SUCCEEDED and traj.final_reward == 1.0
    (call,) = traj.llm_calls
    assert call.token_ids_source == "engine" and call.model == SERVED_NAME and call.response_token_ids
    (span,) = [x for x in traced.spans(done.rollout_id) if x.kind == "CLIENT"]
    assert span.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.7  # the trainer's, not the agent's 0.0
    with pytest.raises(lrl.ConfigurationError, match="upstream="):  # no endpoint chosen: the fix named
        asyncio.run(agent({"q": 2}))


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
    # the tool is not forced: a named tool choice samples under a grammar mask whose log-probs the
    # trainer does not compute (gap ~0.02, measured); the model calls the tool or not, as it likes
    agent = lrl.command(["node", str(NODE_AGENT)], upstream=vllm_url, env={"AGENT_MODEL": "policy"})
    tasks = [{"a": 20 + i, "b": 30 + i} for i in range(4)]
    trainer = Trainer(agent=agent, tasks=tasks, store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                      out_dir=tmp_path, n=2, tasks_per_step=2, steps=1, local=LocalConfig(lr=1e-3), progress=False)
    try:
        result = trainer.fit()
    finally:
        tracing.versions.forget("policy")
    (line,) = [x for x in result.history if "train_reward" in x]
    calls = sum(len(t.llm_calls) for t in lrl.trajectories(traced, mode="train"))
    assert line["outcomes"] == {"succeeded": 4} and line["samples"] == calls >= 4 and line["policy_version"] == 1
    # the trainer recomputes the engine's log-probs (0.0015 apart in the one run that printed it, on these
    # tool-laden prompts sampled at T=1; calls under a grammar mask were 0.02 apart)
    assert line["calls_without_engine_ids"] == 0 and line["engine_logprob_gap"] < 5e-3
    assert [p.version for p in traced.policies("policy")] == [0, 1]
