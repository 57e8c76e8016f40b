"""scripts/run_suites.py, which `make test` runs: every step runs, and the last screen names what failed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_suites.py"


def run_suites(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_a_failed_suite_does_not_stop_another_lane_and_its_failed_tests_are_named_at_the_end():
    failing = ("printf 'F.\\nFAILED tests/test_x.py::test_y - AssertionError: assert 2 == 3\\n"
               "1 failed, 1 passed in 0.10s\\n'; exit 1")
    done = run_suites("--lane", "a", "--lane", "b", "setup=true", f"a={failing}", "b=echo '4 passed in 1.00s'")
    assert done.returncode == 1, done.stdout
    table = done.stdout[done.stdout.index("make test, step by step:"):].splitlines()
    assert any(line.split()[:2] == ["setup", "ok"] for line in table), table
    assert any(line.split()[:2] == ["a", "FAILED"] and "1 failed, 1 passed" in line for line in table), table
    assert any(line.split()[:2] == ["b", "ok"] and "4 passed" in line for line in table), table
    assert "  [a] FAILED tests/test_x.py::test_y - AssertionError: assert 2 == 3" in table, table
    assert table[-1].split()[:3] == ["in", "all", "FAILED"] and "failed or not run: a" in table[-1], table


def test_a_failed_set_up_step_stops_the_run_and_the_lanes_are_reported_as_not_run():
    done = run_suites("--lane", "a", "setup=exit 3", "a=echo never")
    assert done.returncode == 1
    assert "never" not in done.stdout.replace("a=echo never", "")
    table = done.stdout[done.stdout.index("make test, step by step:"):].splitlines()
    assert any(line.split()[:2] == ["setup", "FAILED"] and "exit status 3" in line for line in table), table
    assert any(line.split()[:3] == ["a", "not", "run"] for line in table), table


def test_every_step_passing_exits_zero():
    assert run_suites("--lane", "a", "setup=true", "a=true").returncode == 0
