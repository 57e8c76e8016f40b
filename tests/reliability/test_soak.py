"""The soak test: 2 runner processes x concurrency 16 of a sync agent with a long-tailed tool, against
the store server with 2 workers, for LIGHTNING_RL_SOAK_SECONDS (300 for the figures in
docs/reliability.md; make test runs 120), while one runner is killed with SIGKILL and the server is
killed with SIGKILL and started again. Afterwards every try has exactly one outcome, no rollout is
left running, and no succeeded rollout is outside the queue."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import threading
import time

import pytest

from lightning_rl.store import wait_for_groups
from lightning_rl.store.http.client import HttpStore

from .conftest import start_runner, write_figures

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

TOOLS = 3
N = 4  # tries per task (one GRPO group)


def _runner(server, spill_env, tmp_path, name):
    return start_runner(server.url, spill_env, tmp_path / f"{name}.json", agent="tests.reliability.runner_agents:long_tail",
                        concurrency=16, lease_seconds=20, idle_exit=15)


def test_soak_two_runners_long_tailed_tools_a_killed_runner_and_a_server_restart(server_factory, spill_env, tmp_path):
    seconds = float(os.environ.get("LIGHTNING_RL_SOAK_SECONDS", "120"))
    server = server_factory(workers=2)
    client = HttpStore(server.url, spill_dir=tmp_path / "spill-feeder", retry_for=120)
    groups: list[str] = []
    stop_feeding = threading.Event()

    def feed() -> None:  # keep about 64 tries waiting, as a training loop or production traffic would
        seed = 0
        while not stop_feeding.is_set():
            waiting = sum(1 for e in client.queue_entries(groups[-40:]) if e.status == "queued") if groups else 0
            for _ in range(max(0, (64 - waiting) // N)):
                groups.append(client.enqueue({"seed": seed, "tools": TOOLS}, n=N)[0].group_id)
                seed += 1
            stop_feeding.wait(0.5)

    feeder = threading.Thread(target=feed, daemon=True)
    t0 = time.monotonic()
    feeder.start()
    runners = {"a": _runner(server, spill_env, tmp_path, "a"), "b": _runner(server, spill_env, tmp_path, "b")}
    events = {}
    time.sleep(seconds * 0.3)
    os.kill(runners["a"].pid, signal.SIGKILL)  # a runner dies mid-rollouts: its leases must expire and retry
    runners["a"].wait(30)
    events["runner_killed_at_s"] = round(time.monotonic() - t0, 1)
    runners["c"] = _runner(server, spill_env, tmp_path, "c")
    time.sleep(seconds * 0.3)
    server.kill()  # the store server crashes under load and comes back on the same port
    events["server_killed_at_s"] = round(time.monotonic() - t0, 1)
    time.sleep(3.0)
    server.start()
    events["server_back_at_s"] = round(time.monotonic() - t0, 1)
    time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    stop_feeding.set()
    feeder.join(130)
    assert wait_for_groups(client, groups, timeout=240), "some tries never finished"
    for name in ("b", "c"):
        assert runners[name].wait(120) == 0, runners[name].stderr.read()
    wall = time.monotonic() - t0

    entries = client.queue_entries(groups)
    conn = sqlite3.connect(server.db)
    try:
        statuses = dict(conn.execute("SELECT rollout_id, status FROM rollouts").fetchall())
        spans = dict(conn.execute("SELECT rollout_id, COUNT(*) FROM spans GROUP BY rollout_id").fetchall())
        duplicated = conn.execute("SELECT COUNT(*) - COUNT(DISTINCT trace_id || span_id) FROM spans").fetchone()[0]
    finally:
        conn.close()
    outcomes: dict[str, int] = {}
    for e in entries:
        outcomes[str(e.outcome)] = outcomes.get(str(e.outcome), 0) + 1
    referenced = {e.rollout_id for e in entries}
    succeeded = {r for r, s in statuses.items() if s == "succeeded"}
    running = [r for r, s in statuses.items() if s == "running"]
    reports = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("b", "c")}
    latencies = [x for r in reports.values() for x in r["write_latencies_s"]]
    counters = [r["counters"] for r in reports.values()]
    figures = {
        "seconds": seconds, "wall_s": round(wall, 1), "runners": "2 x concurrency 16 (a killed, c started)",
        "tasks": len(groups), "tries": len(entries), "outcomes": outcomes,
        "tries_per_s": round(len(entries) / wall, 1), "retried_tries": sum(1 for e in entries if e.tries > 1),
        "rollouts": len(statuses), "timed_out_rollouts": sum(1 for s in statuses.values() if s == "timed_out"),
        "running_rollouts": len(running), "succeeded_outside_queue": len(succeeded - referenced),
        "succeeded_with_all_spans": sum(1 for r in succeeded if spans.get(r) == TOOLS + 1),
        "duplicated_spans": duplicated, "spilled_ops": sum(c.get("spilled_ops", 0) for c in counters),
        "spill_files_replayed": sum(c.get("spill_files_replayed", 0) for c in counters),
        "rejected_ops": sum(c.get("rejected_ops", 0) for c in counters),
        "write_p50_ms": round(1000 * statistics.median(latencies), 1) if latencies else None,
        "write_p99_ms": round(1000 * sorted(latencies)[int(0.99 * len(latencies))], 1) if latencies else None,
        **events,
    }
    write_figures("soak", figures)
    assert len(entries) == N * len(groups) and all(e.status == "done" for e in entries)
    assert sum(outcomes.values()) == len(entries)  # exactly one outcome per try
    assert running == [], f"{len(running)} rollouts stuck in running"
    assert succeeded <= referenced, f"{len(succeeded - referenced)} succeeded rollouts outside the queue"
    for e in entries:  # the queue's outcome is the rollout's own status
        assert statuses.get(e.rollout_id) == str(e.outcome), (e, statuses.get(e.rollout_id))
    assert figures["succeeded_with_all_spans"] == len(succeeded) and duplicated == 0
    assert figures["retried_tries"] > 0 and figures["timed_out_rollouts"] > 0  # the killed runner's tries came back
    assert figures["rejected_ops"] == 0
    client.close()
