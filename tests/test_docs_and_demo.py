"""The README quickstart works when pasted, and the spine demo runs end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT, ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _quickstart() -> str:
    section = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quickstart_runs_as_pasted(tmp_path):
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "tiny-qwen2").symlink_to(ensure_tiny_model())  # the quickstart names .cache/tiny-qwen2
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_RL_STORE"}
    result = subprocess.run([sys.executable, "-c", _quickstart()], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    status, final_reward, *_ = result.stdout.split()
    assert status == "succeeded" and float(final_reward) in (0.0, 1.0)
    assert (tmp_path / "runs.db").exists()


def test_spine_demo_prints_a_summary_line(tmp_path, vllm_url):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "spine_demo.py"), "--base-url", vllm_url,
         "--out", str(tmp_path), "--tasks", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["rollouts"] == 4 and summary["succeeded"] == 4
    assert summary["llm_calls"] == 8 and summary["llm_calls_with_engine_token_ids"] == 8
    assert summary["trajectory_samples"] >= 4
    assert "lightning-rl rollouts show" in result.stdout and "tokens (engine)" in result.stdout
    assert (tmp_path / "samples.jsonl").read_text().count("\n") == summary["trajectory_samples"]


def test_rl_demo_runs_and_prints_its_result_line(tmp_path, vllm_url):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "calculator_rl" / "train.py"), "--server-url", vllm_url,
         "--model-dir", str(ensure_tiny_model()),
         "--out", str(tmp_path / "demo"), "--steps", "2", "--n", "2", "--tasks-per-step", "2", "--eval-tasks", "4"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"success_before", "success_after", "minutes", "peak_rss_mb", "plot"} <= set(line)
    assert 0.0 <= line["success_before"] <= 1.0 and 0.0 <= line["success_after"] <= 1.0
    assert (tmp_path / "demo" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert "held-out success" in result.stdout
