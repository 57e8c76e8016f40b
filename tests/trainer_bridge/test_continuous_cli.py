"""``train continuous``'s safety options: mistakes are one line, before any model is loaded."""

from __future__ import annotations

import json

from click.testing import CliRunner

from lightning_rl.cli import main


def _run(*args):
    return CliRunner().invoke(main, ["train", "continuous", "--model-dir", "nowhere", "--server-url",
                                     "http://127.0.0.1:9", *args])


def test_the_gate_needs_its_tasks_and_its_agent(tmp_path):
    tasks = tmp_path / "gate.jsonl"
    tasks.write_text(json.dumps({"question": "2+2"}) + "\n")
    alone = _run("--gate-tasks", str(tasks), "--store", str(tmp_path / "s.db"))
    assert alone.exit_code == 1 and "needs both --gate-tasks FILE and --gate-agent module:function" in alone.output
    agent_only = _run("--gate-agent", "tests.trainer_bridge.cli_agents:add", "--store", str(tmp_path / "s.db"))
    assert agent_only.exit_code == 1 and "got only --gate-agent" in agent_only.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    nothing = _run("--gate-tasks", str(empty), "--gate-agent", "x:y", "--store", str(tmp_path / "s.db"))
    assert nothing.exit_code == 1 and "holds no task" in nothing.output


def test_too_few_gate_tries_and_a_bad_confidence_are_refused(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text('"2+2"\n')
    agent = "tests.trainer_bridge.cli_agents:add"
    few = _run("--gate-tasks", str(one), "--gate-agent", agent, "--store", str(tmp_path / "s.db"))
    assert few.exit_code == 1 and "at least 2 tries per policy; got 1 task(s) x gate_n=1" in few.output
    sure = _run("--gate-tasks", str(one), "--gate-agent", agent, "--gate-n", "4", "--gate-confidence", "1.0",
                "--store", str(tmp_path / "s.db"))
    assert sure.exit_code == 1 and "gate_confidence" in sure.output and "Traceback" not in sure.output


def test_a_canary_share_outside_zero_to_one_is_refused_naming_it(tmp_path):
    whole = _run("--canary", "1.0", "--store", str(tmp_path / "s.db"))
    assert whole.exit_code == 1 and "canary" in whole.output and "1.0" in whole.output
    assert "Traceback" not in whole.output
    minus = _run("--canary", "-0.1", "--store", str(tmp_path / "s.db"))
    assert minus.exit_code == 1 and "canary" in minus.output and "-0.1" in minus.output
    few = _run("--canary", "0.1", "--canary-min-rollouts", "0", "--store", str(tmp_path / "s.db"))
    assert few.exit_code == 1 and "canary_min_rollouts" in few.output
