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


# A short run of the demo whose held-out success must rise: a broken loss fails CI. Measured on this
# 2-core machine with the seed-0 tiny model, steps 12, n 4, 8 tasks per step, 16 held-out tasks, training
# seeds 0..5: gains +0.188, +0.312, +0.688, +0.438, +1.0, +0.188 (min +0.188). The same runs with the
# policy loss's advantages negated: seed 0 +0.062, 2 -0.188, 4 0.0, 5 -0.125. The margin is below every
# measured gain; the seed run here (2: +0.688, twice) leaves room for another CPU's last bits.
SHORT_RUN = ["--steps", "12", "--n", "4", "--tasks-per-step", "8", "--eval-tasks", "16", "--seed", "2"]
MARGIN = 0.125


def test_a_short_demo_run_raises_held_out_success(tmp_path, vllm_url):
    built = json.loads((ensure_tiny_model() / "lightning_rl_tiny.json").read_text())
    if built["seed"] != 0:
        # How much 12 steps teach depends on where the model starts: the seed-1 model calls its tool with
        # a wrong expression almost always (train reward 0.03, held-out 0.0) and learned nothing in 12 steps.
        pytest.skip(f"the margin was measured on the seed-0 model (`make model`); this one has seed {built['seed']}")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "calculator_rl" / "train.py"), "--server-url", vllm_url,
         "--model-dir", str(ensure_tiny_model()), "--out", str(tmp_path / "demo"), *SHORT_RUN],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"success_before", "success_after", "minutes", "peak_rss_mb", "plot"} <= set(line)
    assert line["success_after"] - line["success_before"] >= MARGIN, line
    assert (tmp_path / "demo" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert "held-out success" in result.stdout
    steps = [json.loads(x) for x in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in steps if "train_reward" in x]
    assert len(train) == 12 and all(x["optimizer_steps"] >= 1 for x in train)
    # 32 samples a step, mini-batches of 16: the second step starts off the proximal policy and the clip acts
    # (measured: clip fraction > 0 in 7 of 12 steps for seed 2, at most 0.0085)
    assert any(x["pg_clipfrac"] > 0 for x in train)
