"""``bench/bench_capture_peers.py`` (issue 57) runs, checks what ours recorded, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_checks_its_capture_and_removes_its_workers_stores(tmp_path):
    """Every run left its worker logs and stores (tens of MB, a SQLite file a contender and shape) under TMPDIR:
    12 directories after one session of runs. A run whose contenders all succeeded now removes them."""
    work = tmp_path / "tmp"
    work.mkdir()
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_capture_peers.py"), "--shapes", "40+4", "--clients", "default",
         "--contenders", "lightning-rl", "--rounds", "3", "--calls", "20", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "TMPDIR": str(work)})
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["status"] == "ok" and row["check"]["ok"], row
    assert row["check"]["llm_calls_stored"] == row["check"]["llm_calls_expected"] > 0
    assert "workers' logs and stores" in done.stderr
    assert list(work.iterdir()) == []  # nothing left behind
