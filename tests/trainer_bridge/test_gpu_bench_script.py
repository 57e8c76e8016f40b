"""The GPU training-step bench runs (at a tiny shape on CPU) and reports what it claims."""

import json
import subprocess
import sys

import pytest

from ..conftest import ROOT

pytest.importorskip("peft")


@pytest.mark.slow
def test_gpu_bench_tiny_on_cpu():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_train_step.py"), "--tiny", "--device", "cpu"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["tokens_per_s"] > 0 and line["params"] > 0 and line["device"] == "cpu"


@pytest.mark.slow
def test_the_bf16_logprob_gap_bench_runs_on_cpu_and_reports_a_gap():
    from ..conftest import ensure_tiny_model

    result = subprocess.run([sys.executable, str(ROOT / "bench" / "logprob_precision.py"), "--model-dir",
                             str(ensure_tiny_model()), "--device", "cpu", "--batch", "2", "--response", "16"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["tokens"] == 32 and line["max_abs_logprob_gap"] > 0  # bf16 is not fp32
    assert line["token_ratio_min"] <= 1.0 <= line["token_ratio_max"]


def test_the_lora_merge_bench_finds_no_gap_in_fp32_and_one_in_bf16():
    """--lora-merge-bf16 on a tiny random model: merging alone (fp32) leaves the log-probs as they were, merging in
    bf16 moves them, and less than the adapter itself does."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "logprob_precision.py"), "--tiny", "--device", "cpu",
                             "--lora-merge-bf16", "--batch", "2", "--prompt", "8", "--response", "8"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = {line["comparison"]: line for line in map(json.loads, result.stdout.strip().splitlines())}
    headline = lines["bf16_actor_vs_bf16_merged_engine"]
    assert {"max_abs_logprob_gap", "mean_abs_logprob_gap", "abs_logprob_gap_q99", "token_ratio_min",
            "token_ratio_max", "token_ratio_outside_1/2_2", "lora_rank", "lora_init_std"} <= headline.keys()
    assert headline["tokens"] == 16 and headline["sampled_by"] == "engine_bf16_merged"
    assert lines["control_fp32_actor_vs_fp32_merged"]["max_abs_logprob_gap"] < 1e-5  # merging is exact in fp32
    assert headline["max_abs_logprob_gap"] > 1e-4  # in bf16 it is not: round(W + BA) is not round(W) + round(B)round(A)
    assert headline["max_abs_logprob_gap"] < lines["adapter_effect_fp32_actor_vs_base"]["max_abs_logprob_gap"]
