"""Every example runs with one command against the real vLLM server and captures what it claims."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from .conftest import ROOT

EXAMPLES = ROOT / "examples"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "script,agents,trained",
    [
        ("openai_plain/agent.py", {"solver", "checker"}, "solver"),
        ("autogen_team/team.py", {"solver", "checker"}, "solver"),
        ("langchain_sql/agent.py", {"sql_agent"}, "sql_agent"),
    ],
)
def test_example_runs_and_captures(script, agents, trained, vllm_url, tmp_path):
    env = {**os.environ, "LIGHTNING_RL_BASE_URL": vllm_url, "LIGHTNING_RL_MODEL": "tiny"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--tasks", "2", "--store", f"sqlite:///{tmp_path / 'ex.db'}"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["rollouts"] == 2
    assert set(summary["llm_calls_per_agent"]) == agents
    assert summary["llm_calls_with_engine_token_ids"] == summary["llm_calls"] > 0
    if len(agents) > 1:
        assert 0 < summary[f"samples_{trained}_only"] < summary["samples_all_agents"]


def test_sql_example_gold_queries_run_on_the_shipped_database():
    db = sqlite3.connect(EXAMPLES / "langchain_sql" / "shop.db")
    questions = [json.loads(line) for line in (EXAMPLES / "langchain_sql" / "questions.jsonl").read_text().splitlines()]
    assert len(questions) == 10
    for q in questions:
        rows = db.execute(q["gold_sql"]).fetchall()
        assert rows and rows[0][0] is not None, q
