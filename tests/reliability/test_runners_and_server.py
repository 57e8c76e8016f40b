"""Many runner processes, a runner killed mid-rollout, a server killed under load: nothing lost,
nothing twice. Everything runs as separate processes started by the CLI (`store serve`, `runner`)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import QueueStatus, RolloutStatus
from lightning_rl.store import wait_for_groups
from lightning_rl.store.http.client import HttpStore

from .conftest import start_runner, write_figures

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

SPANS = 20  # tool spans per rollout; the rollout's own span makes 21


def _check_stored(db, group_ids: list[str] | None = None) -> dict:
    """Per-rollout span counts straight from the SQLite file, and duplicates by OTel span id."""
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        per_rollout = dict(conn.execute("SELECT rollout_id, COUNT(*) FROM spans GROUP BY rollout_id").fetchall())
        rows, distinct = conn.execute("SELECT COUNT(*), COUNT(DISTINCT trace_id || span_id) FROM spans").fetchone()
        statuses = dict(conn.execute("SELECT rollout_id, status FROM rollouts").fetchall())
    finally:
        conn.close()
    return {"per_rollout": per_rollout, "rows": rows, "duplicated": rows - distinct, "statuses": statuses}


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_eight_runner_processes_through_one_server(server_factory, spill_env, tmp_path):
    server = server_factory(workers=2)
    client = HttpStore(server.url, spill_dir=tmp_path / "spill-test")
    tasks = 640
    groups = [client.enqueue({"spans": SPANS, "pad": 200}, n=4)[0].group_id for _ in range(tasks // 4)]
    reports = [tmp_path / f"runner-{i}.json" for i in range(8)]
    t0 = time.time()
    runners = [start_runner(server.url, spill_env, report) for report in reports]
    for proc in runners:
        assert proc.wait(300) == 0, proc.stderr.read()
    assert wait_for_groups(client, groups, timeout=10)
    entries = client.queue_entries(groups)
    assert all(e.status == QueueStatus.DONE and e.outcome == RolloutStatus.SUCCEEDED for e in entries)

    stored = _check_stored(server.db)
    succeeded = [r for r, status in stored["statuses"].items() if status == "succeeded"]
    expected = tasks * (SPANS + 1)
    lost = sum(SPANS + 1 - stored["per_rollout"].get(r, 0) for r in succeeded)
    rollouts = client.rollouts()
    wall = max(r.end_time for r in rollouts) - min(r.start_time for r in rollouts)
    latencies = [x for report in reports for x in json.loads(report.read_text())["write_latencies_s"]]
    ran = [json.loads(report.read_text())["ran"] for report in reports]
    figures = {
        "runner_processes": 8, "rollouts": tasks, "spans_expected": expected, "spans_stored": stored["rows"],
        "lost": lost, "duplicated": stored["duplicated"], "tries_per_runner": ran,
        "wall_s": round(wall, 2), "spans_per_s": round(stored["rows"] / wall),
        "write_requests": len(latencies), "write_p50_ms": round(1000 * statistics.median(latencies), 1),
        "write_p99_ms": round(1000 * _percentile(latencies, 0.99), 1), "since_start_s": round(time.time() - t0, 1),
    }
    write_figures("eight_runners", figures)
    assert len(succeeded) == tasks and stored["rows"] == expected and lost == 0 and stored["duplicated"] == 0
    assert sum(ran) == tasks and sum(1 for n in ran if n > 0) >= 4  # the work really was shared
    client.close()


def test_runner_killed_mid_rollout_is_retried_and_its_partial_try_kept_apart(server_factory, spill_env, tmp_path):
    server = server_factory()
    client = HttpStore(server.url, spill_dir=tmp_path / "spill-test")
    entry = client.enqueue({"spans": 10, "sleep": 0.3}, n=1, max_tries=3)[0]
    victim = start_runner(server.url, spill_env, tmp_path / "victim.json", concurrency=1, lease_seconds=2)
    deadline = time.monotonic() + 60
    first = None
    while time.monotonic() < deadline:  # wait until the victim has written part of its rollout
        leased = [e for e in client.queue_entries([entry.group_id]) if e.rollout_id]
        if leased and client.existing_rollout_ids([leased[0].rollout_id]):
            first = leased[0].rollout_id
            if len(client.spans(first)) >= 3:
                break
        time.sleep(0.1)
    assert first is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(30)
    partial = len(client.spans(first))

    rescuer = start_runner(server.url, spill_env, tmp_path / "rescuer.json", concurrency=1, lease_seconds=2)
    assert wait_for_groups(client, [entry.group_id], timeout=60)
    assert rescuer.wait(60) == 0, rescuer.stderr.read()
    done = client.queue_entries([entry.group_id])[0]
    assert done.outcome == RolloutStatus.SUCCEEDED and done.tries == 2 and done.rollout_id != first
    killed, retried = lrl.trajectory(client, first), lrl.trajectory(client, done.rollout_id)
    assert killed.status == RolloutStatus.TIMED_OUT and "expired" in (killed.error or "")
    assert 3 <= partial < 11 and len(client.spans(first)) == partial  # the partial try is kept as it was
    assert retried.status == RolloutStatus.SUCCEEDED and len(client.spans(done.rollout_id)) == 11
    assert {s.span_id for s in client.spans(first)}.isdisjoint({s.span_id for s in client.spans(done.rollout_id)})
    trained_on = {t.rollout_id for t in lrl.trajectories(client, status="succeeded")}
    assert trained_on == {done.rollout_id}  # never mixed into training data
    write_figures("runner_killed", {"partial_spans_kept": partial, "retry_spans": 11, "tries": done.tries,
                                    "partial_status": killed.status.value, "retry_status": retried.status.value})
    client.close()


def test_server_killed_and_restarted_under_load(server_factory, spill_env, tmp_path):
    server = server_factory()
    client = HttpStore(server.url, spill_dir=tmp_path / "spill-test", retry_for=120)
    tasks = 160
    groups = [client.enqueue({"spans": SPANS, "sleep": 0.01}, n=4)[0].group_id for _ in range(tasks // 4)]
    reports = [tmp_path / f"runner-{i}.json" for i in range(4)]
    runners = [start_runner(server.url, spill_env, report, idle_exit=4) for report in reports]
    deadline = time.monotonic() + 60
    while len(client.rollouts()) < 20 and time.monotonic() < deadline:  # the runners are at work
        time.sleep(0.05)
    before = len(client.rollouts())
    server.kill()  # SIGKILL: in-flight batches are never acknowledged, so clients keep them
    down = 3.0
    time.sleep(down)
    spilled_files = len(list((tmp_path / "spill").glob("*.jsonl")))
    server.start()
    for proc in runners:
        assert proc.wait(300) == 0, proc.stderr.read()
    assert wait_for_groups(client, groups, timeout=30)

    stored = _check_stored(server.db)
    succeeded = [r for r, status in stored["statuses"].items() if status == "succeeded"]
    lost = sum(SPANS + 1 - stored["per_rollout"].get(r, 0) for r in succeeded)
    counters = [json.loads(r.read_text())["counters"] for r in reports]
    figures = {
        "runner_processes": 4, "rollouts": tasks, "rollouts_before_kill": before, "server_down_s": down,
        "spill_files_while_down": spilled_files, "spilled_ops": sum(c.get("spilled_ops", 0) for c in counters),
        "spill_files_replayed": sum(c.get("spill_files_replayed", 0) for c in counters),
        "spans_stored": stored["rows"], "lost": lost, "duplicated": stored["duplicated"],
        "spill_files_left": len(list((tmp_path / "spill").glob("*.jsonl"))),
    }
    write_figures("server_restart", figures)
    assert 0 < before < tasks  # the kill happened mid-run
    assert figures["spilled_ops"] > 0 and figures["spill_files_replayed"] > 0  # the outage was felt and healed
    assert len(succeeded) == tasks and lost == 0 and stored["duplicated"] == 0
    assert stored["rows"] == tasks * (SPANS + 1) and figures["spill_files_left"] == 0
    assert not list((tmp_path / "spill").glob("rejected-*"))
    client.close()
