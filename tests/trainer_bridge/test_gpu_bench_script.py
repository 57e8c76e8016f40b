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
