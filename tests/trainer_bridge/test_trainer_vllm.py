"""Trainer.fit end to end on the real vLLM server: groups, updates, hot-swaps, metrics, plot."""

from __future__ import annotations

import json

import openai
import pytest

import lightning_rl as lrl
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.config import LocalConfig
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
        tracing.versions.forget("policy")
    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    train = [x for x in lines if "train_reward" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["policy_version"] == x["step"] for x in train)
    # synchronous (max_staleness=0): every sample was served by the version being updated, none ran meanwhile
    assert all(set(x["staleness"]) == {"0"} and x["samples_dropped_stale"] == 0 for x in train)
    assert all(x["groups_in_flight"] == 0 for x in train)
    # the engine served the weights the trainer computed its proximal log-probs with (processed log-probs)
    assert all(x["optimizer_steps"] >= 1 and x["engine_logprob_gap"] < 1e-3 for x in train)
    evals = [x for x in lines if "eval_success" in x]
    assert [x["eval_success"] for x in evals] == [result.eval_before, result.eval_after]
    assert result.plot_path.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "adapters" / "v00002").is_dir()
    # spans record which policy version served them; failed rollouts are counted, kept, not trained on
    versions = {c.policy_version for t in lrl.trajectories(traced, mode="train") for c in t.llm_calls}
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


def test_fit_a_team_with_a_policy_per_agent(traced, vllm_url, tmp_path):
    """Two agents, each on its own LoRA of the one base model, served under their own names; a third
    call goes to the base model, which nobody trains. Whatever the model says, every rollout makes
    one call per name, so the counts below are exact."""
    client = openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY")
    names = {"planner": "planner-lora", "solver": "solver-lora"}

    @lrl.trace
    async def team(task):
        async def ask(model, text):
            r = await client.chat.completions.create(model=model, max_tokens=4, temperature=1.0,
                                                     messages=[{"role": "user", "content": text}])
            return r.choices[0].message.content

        with lrl.agent_scope("planner"):
            plan = await ask(names["planner"], f"Plan: {task['a']}+{task['b']}")
        with lrl.agent_scope("solver"):
            answer = await ask(names["solver"], f"{plan} Solve: {task['a']}+{task['b']}")
            await ask("tiny", "Check it.")  # the base model: nobody's policy
            lrl.emit_reward(float(len(answer) % 2), agent="solver")  # the solver's own measure
        return float(len(plan + answer) % 3 == 0)  # the team's reward

    tasks = [{"a": 20 + i, "b": 30 + i} for i in range(4)]
    trainer = Trainer(agent=team, tasks=tasks, store=traced, model_dir=ensure_tiny_model(), server_url=vllm_url,
                      out_dir=tmp_path, n=2, tasks_per_step=2, steps=2, policies=names, credit="team",
                      local=LocalConfig(lr=1e-3), progress=False, seed=3)
    try:
        result = trainer.fit()
    finally:
        for name in names.values():
            tracing.versions.forget(name)
    train = [json.loads(x) for x in result.metrics_path.read_text().splitlines() if "train_reward" in x]
    assert [x["policy_version"] for x in train] == [1, 2]
    for line in train:
        assert line["samples_unrouted"] == 4 and line["samples_off_their_policy"] == 4  # the calls to "tiny"
        for name in names.values():
            policy = line["policies"][name]
            assert policy["samples"] == 4 and policy["optimizer_steps"] >= 1
            assert policy["engine_logprob_gap"] < 1e-3  # vLLM served each policy's own adapter
            assert policy["adapter_mb"] > 0 and policy["optimizer_mb"] > 0
    for name in names.values():
        assert [p.version for p in traced.policies(name)] == [0, 1, 2]
        assert (tmp_path / "adapters" / name / "v00002" / "adapter_model.safetensors").is_file()
    # each call records its own served name and that policy's version
    calls = [c for t in lrl.trajectories(traced, mode="train") for c in t.llm_calls]
    by_name = {}
    for c in calls:
        by_name.setdefault(c.model, set()).add(c.policy_version)
    assert by_name["planner-lora"] == by_name["solver-lora"] == {0, 1}


def test_train_run_trains_a_task_set_from_the_command_line(traced, vllm_url, tmp_path, monkeypatch):
    """`lightning-rl train run`: the agent by name, the tasks from a file, Trainer.fit underneath."""
    from click.testing import CliRunner

    from lightning_rl.cli import main

    from .cli_agents import BASE_URL

    monkeypatch.setenv(BASE_URL, vllm_url)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"a": 20 + i, "b": 30 + i}) + "\n" for i in range(3)))
    try:
        result = CliRunner().invoke(main, [
            "train", "run", "--agent", "tests.trainer_bridge.cli_agents:add", "--tasks", str(tasks),
            "--store", traced.url, "--model-dir", str(ensure_tiny_model()), "--server-url", vllm_url, "--n", "2",
            "--tasks-per-step", "2", "--steps", "2", "--lr", "1e-3", "--out", str(tmp_path / "run")])
    finally:
        tracing.versions.forget("policy")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["metrics"] == str(tmp_path / "run" / "metrics.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["policy_version"] for x in lines] == [1, 2]
    assert all(x["policies"]["policy"]["samples"] == x["samples"] == 4 for x in lines)  # 2 tasks x 2 tries, 1 call
    assert [p.version for p in traced.policies("policy")] == [0, 1, 2]
    assert len(traced.rollouts(mode="train")) == 8


def test_a_policy_name_the_server_does_not_serve_is_refused(vllm_url):
    from lightning_rl.trainer_bridge.publishers import check_served

    with pytest.raises(lrl.ConfigurationError, match="does not serve 'ghost-lora'.*--max-loras 1"):
        check_served(vllm_url, ["ghost-lora"])
    with pytest.raises(lrl.ConfigurationError, match="'tiny' is the base model's own name"):
        check_served(vllm_url, ["tiny"])


def test_a_real_autogen_team_trains_a_lora_per_agent(traced, vllm_url, tmp_path):
    """AutoGen's RoundRobinGroupChat, each AssistantAgent on its own model client and served LoRA:
    one fit step trains both adapters from the team's shared reward."""
    pytest.importorskip("autogen_agentchat")
    from ..adapters import autogen_agents as ag

    names = {"solver": "solver-lora", "checker": "checker-lora"}

    @lrl.trace
    async def team(task):
        result = await ag.round_robin(vllm_url, models=names).run(task=f"What is {task['a']}+{task['b']}?")
        return float(str(task["a"] + task["b"]) in str(result.messages[-1].content))  # the team's reward

    trainer = Trainer(agent=team, tasks=[{"a": 12, "b": 30}, {"a": 41, "b": 17}], store=traced,
                      model_dir=ensure_tiny_model(), server_url=vllm_url, out_dir=tmp_path, n=2, tasks_per_step=2,
                      steps=1, policies=names, credit="team", local=LocalConfig(lr=1e-3), progress=False)
    try:
        result = trainer.fit()
    finally:
        for name in names.values():
            tracing.versions.forget(name)
    (line,) = [json.loads(x) for x in result.metrics_path.read_text().splitlines() if "train_reward" in x]
    assert line["outcomes"] == {"succeeded": 4}
    assert line["samples_unrouted"] == 0 and line["samples_off_their_policy"] == 0
    for agent, name in names.items():
        assert line["policies"][name]["samples"] >= 4 and line["policies"][name]["policy_version"] == 1
        assert [p.version for p in traced.policies(name)] == [0, 1]
    calls = [c for t in lrl.trajectories(traced, mode="train") for c in t.llm_calls]
    assert {(c.agent_name, c.model) for c in calls} == set(names.items())  # AutoGen's names, each on its LoRA
    assert all(c.policy_version == 0 and c.prompt_token_ids and c.response_token_ids for c in calls)
