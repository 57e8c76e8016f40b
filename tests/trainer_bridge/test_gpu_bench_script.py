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
