"""Zero-code AutoGen tracing (autogen-agentchat 0.7) against the real vLLM server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl.store import trajectory_samples

# A named tool_choice ends with finish_reason "stop" (as OpenAI does), which AutoGen warns about.
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore:Finish reason mismatch:UserWarning")]
pytest.importorskip("autogen_agentchat")

from . import autogen_agents as ag  # noqa: E402

QUESTION = "What is 12+30?"


def _spans(store, rollout_id):
    return {s.span_id: s for s in store.spans(rollout_id)}


def _check_ids(t):
    assert t.llm_calls
    for c in t.llm_calls:
        assert c.token_ids_source == "engine" and c.prompt_token_ids and c.response_token_ids, c


async def test_single_agent_with_tool(traced, vllm_url):
    agent = ag.solver(vllm_url)

    @lrl.trace
    async def run(question):
        await agent.run(task=question)
        return 1.0

    await run(QUESTION)
    (t,) = list(lrl.trajectories(traced))
    _check_ids(t)
    spans = _spans(traced, t.rollout_id)
    agent_span = next(s for s in spans.values() if s.name == "invoke_agent solver")
    assert spans[agent_span.parent_id].parent_id is None  # directly under the rollout root
    first = t.llm_calls[0]
    assert first.agent_name == "solver" and first.parent_id == agent_span.span_id
    (tool_call,) = first.tool_calls
    (tool_span,) = t.tool_spans
    assert tool_span.name == "execute_tool calculator" and tool_span.parent_id == agent_span.span_id
    assert tool_span.attributes["gen_ai.tool.call.id"] == tool_call.id
    assert tool_span.attributes["gen_ai.agent.name"] == "solver"


async def test_round_robin_team_names_every_call_and_streams_ids(traced, vllm_url):
    team = ag.round_robin(vllm_url, stream=True)

    @lrl.trace
    async def run(question):
        await team.run(task=question)
        lrl.emit_reward(0.25, agent="checker")  # the checker's own reward
        return 1.0  # the team's reward

    await run(QUESTION)
    (t,) = list(lrl.trajectories(traced))
    _check_ids(t)
    names = [c.agent_name for c in t.llm_calls]
    assert set(names) == {"solver", "checker"} and names[0] == "solver"
    spans = _spans(traced, t.rollout_id)
    for c in t.llm_calls:
        assert spans[c.parent_id].name == f"invoke_agent {c.agent_name}"
    assert all(c.streamed for c in t.llm_calls if c.agent_name == "solver")
    assert any(s.attributes.get("gen_ai.tool.call.id") for s in t.tool_spans)
    # shared team reward for the solver, the checker's own reward for the checker
    solver_samples, _ = trajectory_samples(t, agents=["solver"])
    checker_samples, _ = trajectory_samples(t, agents="check.*")
    assert solver_samples and {x.reward for x in solver_samples} == {1.0}
    assert checker_samples and {x.reward for x in checker_samples} == {0.25}
    assert {x.agent_name for x in solver_samples} == {"solver"}


async def test_selector_group_chat(traced, vllm_url):
    team = ag.selector(vllm_url)

    @lrl.trace
    async def run(question):
        await team.run(task=question)
        return 1.0

    await run(QUESTION)
    (t,) = list(lrl.trajectories(traced))
    _check_ids(t)
    names = [c.agent_name for c in t.llm_calls]
    assert "selector" in names and set(names) <= {"selector", "solver", "checker"}
    assert set(names) & {"solver", "checker"}


def test_same_spans_when_the_user_has_a_global_provider(vllm_url, tmp_path):
    db = tmp_path / "team.db"
    script = Path(ag.__file__)
    result = subprocess.run([sys.executable, str(script), vllm_url, str(db)], capture_output=True, text=True,
                            timeout=300, cwd=script.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    assert "invoke_agent solver" in theirs  # AutoGen's own spans still reach the user's provider
    with lrl.SQLiteStore(db) as store:
        (t,) = list(lrl.trajectories(store))
        _check_ids(t)
        spans = {s.span_id: s for s in store.spans(t.rollout_id)}
        for c in t.llm_calls:
            assert spans[c.parent_id].name == f"invoke_agent {c.agent_name}"
        assert {c.agent_name for c in t.llm_calls} == {"solver", "checker"}


async def test_nothing_recorded_outside_a_rollout(traced, vllm_url):
    await ag.checker(vllm_url).run(task=QUESTION)
    assert traced.rollouts() == []


def test_autogen_imported_inside_the_first_rollout_names_its_agents(vllm_url, tmp_path):
    script = Path(ag.__file__).with_name("late_import_agent.py")
    result = subprocess.run([sys.executable, str(script), vllm_url, str(tmp_path / "late.db")], capture_output=True,
                            text=True, timeout=300, cwd=script.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["checker", "solver"]  # not "first_rollout"
