"""The coding-agent wrappers' own plumbing, with a stand-in executable (a shell script) where the CLI would
be: the rollout's reward is the caller's, never the number the model answered; how a missing CLI is found
or named; a timeout names the CLI, not the launcher. The real CLIs: test_claude_code_vllm.py and
test_codex_opencode_vllm.py."""

from __future__ import annotations

import asyncio
import os
import stat
import sys

import pytest

import lightning_rl as lrl
from lightning_rl.errors import ConfigurationError
from lightning_rl.gateway.coding_agents import find_cli
from lightning_rl.records import RolloutStatus

pytest.importorskip("fastapi")

UPSTREAM = "http://127.0.0.1:9"  # never called: the stand-in makes no LLM call


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("wrapper", ["claude_code", "codex", "opencode"])
def test_the_number_a_cli_prints_last_is_not_the_reward(traced, tmp_path, wrapper):
    cli = _script(tmp_path / "cli", "cat >/dev/null; echo 449")  # the model's answer, a number
    make = getattr(lrl, wrapper)
    agent = make("Say hi", upstream=UPSTREAM, model="tiny", binary=cli) if wrapper == "claude_code" else \
        make(upstream=UPSTREAM, model="tiny", binary=cli)
    assert asyncio.run(agent("Say hi")) is None
    (traj,) = lrl.trajectories(traced)
    assert traj.final_reward is None and not traj.rewards
    given = (make("Say hi", upstream=UPSTREAM, model="tiny", binary=cli, reward=lambda task, out: float("449" in out))
             if wrapper == "claude_code" else make(upstream=UPSTREAM, model="tiny", binary=cli,
                                                    reward=lambda task, out: float("449" in out)))
    assert asyncio.run(given("Say hi")) == 1.0


def test_a_timeout_names_the_cli_not_the_launcher(traced, tmp_path):
    cli = _script(tmp_path / "codex", "sleep 30")
    agent = lrl.codex(upstream=UPSTREAM, model="tiny", binary=cli, timeout=1)
    with pytest.raises(TimeoutError, match=rf"^{cli} exec ran past its timeout of 1 s"):
        asyncio.run(agent("Say hi"))
    (rollout,) = traced.rollouts()
    assert rollout.status == RolloutStatus.TIMED_OUT and rollout.error.startswith("TimeoutError: " + cli)


def test_a_cli_is_found_in_the_working_folders_node_modules_and_a_missing_one_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_RL_CLAUDE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    # (codex itself is in this checkout's examples/cli_agents, the last place looked)
    with pytest.raises(ConfigurationError, match=r"no nocli executable found .*npm install nocli@1\.0"):
        find_cli(None, "nocli", "LIGHTNING_RL_NOCLI", "nocli@1.0")
    with pytest.raises(ConfigurationError, match=r"binary='/nope' is not an executable file"):
        find_cli("/nope", "claude", "LIGHTNING_RL_CLAUDE", "@anthropic-ai/claude-code@2.1.332")
    (tmp_path / "node_modules" / ".bin").mkdir(parents=True)
    local = _script(tmp_path / "node_modules" / ".bin" / "claude", "true")
    assert os.path.samefile(find_cli(None, "claude", "LIGHTNING_RL_CLAUDE", "x"), local)  # after a local npm install


@pytest.mark.parametrize("wrapper", ["claude_code", "codex", "opencode"])
def test_a_cli_runs_in_the_tasks_folder_and_its_pwd_says_so(traced, tmp_path, wrapper):
    """opencode takes its project folder from ``$PWD``, not the process's working folder: with the trainer's own
    ``$PWD`` inherited, the task's folder was outside its project, reading a file there was an external-directory
    permission that ``opencode run`` refused, and the run ended after the model's first tool call."""
    work = tmp_path / "work"
    work.mkdir()
    cli = tmp_path / "cli"
    # no shell in between (a shell, pyenv's shims included, sets $PWD itself), as with the real opencode binary
    cli.write_text(f"#!{sys.executable}\nimport os\nprint(os.environ.get('PWD'), os.getcwd())\n")
    cli.chmod(cli.stat().st_mode | stat.S_IXUSR)
    in_work = {"reward": lambda task, out: float(out.split() == [str(work)] * 2), "binary": str(cli)}
    # each on the host (sandbox="none"): in its sandbox by default, a CLI runs in /work, a copy of the folder
    # (tests/gateway/test_claude_code_vllm.py, test_codex_opencode_vllm.py), and this fake CLI's interpreter is not there
    agent = (lrl.claude_code("Say hi", upstream=UPSTREAM, model="tiny", cwd=work, sandbox="none", **in_work)
             if wrapper == "claude_code"
             else getattr(lrl, wrapper)(upstream=UPSTREAM, model="tiny", sandbox="none", **in_work))
    assert asyncio.run(agent({"prompt": "Say hi", "cwd": str(work)})) == 1.0  # claude_code: its cwd='s
