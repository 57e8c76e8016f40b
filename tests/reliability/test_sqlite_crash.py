"""kill -9 a process that writes the SQLite file directly: the file stays sound and every rollout
the process saw finish is complete."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, write_figures

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def test_kill_9_of_a_direct_sqlite_writer_loses_no_finished_rollout(tmp_path):
    db = tmp_path / "direct.db"
    rng = random.Random(7)
    reported: list[str] = []
    kills = []
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "reliability" / "sqlite_writer.py"), str(db)],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
        lines: list[str] = []
        stop_after = time.monotonic() + 1.5 + rng.random() * 2
        while time.monotonic() < stop_after:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
        proc.kill()  # SIGKILL, mid-write
        proc.wait(30)
        lines += [line.strip() for line in proc.stdout.read().splitlines()]
        reported += [line for line in lines if line]
        kills.append(len(lines))
    conn = sqlite3.connect(db)
    try:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        marks = ", ".join("?" * len(reported))
        status = dict(conn.execute(f"SELECT rollout_id, status FROM rollouts WHERE rollout_id IN ({marks})", reported))
        spans = dict(conn.execute(f"SELECT rollout_id, COUNT(*) FROM spans WHERE rollout_id IN ({marks}) "
                                  "GROUP BY rollout_id", reported))
        rewards = dict(conn.execute(f"SELECT rollout_id, COUNT(*) FROM rewards WHERE rollout_id IN ({marks}) "
                                    "GROUP BY rollout_id", reported))
        unfinished = conn.execute("SELECT COUNT(*) FROM rollouts WHERE status = 'running'").fetchone()[0]
    finally:
        conn.close()
    incomplete = [r for r in reported if status.get(r) != "succeeded" or spans.get(r) != 21 or rewards.get(r) != 2]
    write_figures("sqlite_kill9", {"kills": 4, "finished_rollouts_reported": len(reported),
                                   "per_kill": kills, "integrity_check": integrity, "incomplete": len(incomplete),
                                   "rollouts_cut_mid_run": unfinished})
    assert integrity == "ok"
    assert len(reported) > 20 and incomplete == []
