"""The task queue at fleet size: one clock per store, a sweep that reads only what expired, long polls.

Every store is real: SQLite files, a PostgreSQL database of the session's server, store servers on
loopback ports (in this process, or a ``lightning-rl store serve`` process where this process's clock
is moved)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from lightning_rl import diagnostics
from lightning_rl.errors import ConfigurationError
from lightning_rl.records import QueueStatus, RolloutStatus
from lightning_rl.store import task_queue
from lightning_rl.store.http.client import HttpStore
from lightning_rl.store.postgres.store import PostgresStore
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.trainer_bridge.runner import Runner

from ..services import wait_healthy
from .test_fleet_cli import _free_port

HOUR = 3600.0


def _clock(monkeypatch, offset: float) -> None:
    """This process's wall clock, ``offset`` seconds off (what a runner machine with a wrong clock sees)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + offset)


@pytest.fixture
def served_sqlite(tmp_path):
    """A `lightning-rl store serve` process over a SQLite file: its clock is not this test's."""
    port = _free_port()
    env = dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path / "spill-server"))
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db",
                             str(tmp_path / "served.db"), "--port", str(port), "--workers", "1"], env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, what="the store server")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("where", ["postgres", "http"])
def test_a_runner_whose_clock_is_an_hour_off_loses_no_try_and_runs_none_twice(where, request, tmp_path, monkeypatch):
    if where == "postgres":
        store = PostgresStore(request.getfixturevalue("pg_url"), retry_for=5.0)
    else:
        store = HttpStore(request.getfixturevalue("served_sqlite"), spill_dir=tmp_path / "spill", retry_for=5.0)
    try:
        group = store.enqueue({"q": 1}, n=2)[0].group_id
        _clock(monkeypatch, -HOUR)  # behind: its lease would end an hour ago on everyone else's clock
        (behind,) = store.lease("behind", lease_seconds=30)
        monkeypatch.undo()
        (fine,) = store.lease("fine", lease_seconds=30, limit=5)  # the other try only: the first is held
        assert fine.queue_id != behind.queue_id
        _clock(monkeypatch, HOUR)  # ahead: every lease would have ended on its clock
        assert store.lease("ahead", lease_seconds=30, limit=5) == []
        monkeypatch.undo()
        _clock(monkeypatch, -HOUR)
        assert store.heartbeat(behind.queue_id, "behind", lease_seconds=30)
        assert store.complete(behind.queue_id, "behind", RolloutStatus.SUCCEEDED)
        monkeypatch.undo()
        assert store.complete(fine.queue_id, "fine", RolloutStatus.SUCCEEDED)
        entries = store.queue_entries([group])
        assert [(e.status, e.tries, e.outcome) for e in entries] == [(QueueStatus.DONE, 1, RolloutStatus.SUCCEEDED)] * 2
    finally:
        monkeypatch.undo()
        store.close()


def _fill(store, leased: int, expired: int) -> None:
    """``leased`` tries held for an hour, ``expired`` whose lease ran out, and one queued."""
    store.enqueue({"q": "held"}, n=leased)
    while store.lease("holder", lease_seconds=HOUR, limit=1000):
        pass
    store.enqueue({"q": "lapsed"}, n=expired)
    assert len(store.lease("dead", lease_seconds=0.05, limit=expired)) == expired
    time.sleep(0.1)
    store.enqueue({"q": "fresh"}, n=1)


def _one_lease_cost(store: SQLiteStore) -> tuple[int, int]:
    """(SQLite VM steps, queue rows written) of one lease on ``store``'s queue connection."""
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    conn = store._qconn  # the connection the queue's transactions run on
    with store._qlock:
        conn.execute("CREATE TEMP TABLE writes (n INTEGER)")
        conn.execute("CREATE TEMP TRIGGER count_writes AFTER INSERT ON main.queue BEGIN "
                     "INSERT INTO writes VALUES (1); END")
        conn.set_progress_handler(step, 100)
    got = store.lease("live", lease_seconds=60, limit=1, key="a-fresh-key")  # a key: the retry lookup runs too
    with store._qlock:
        conn.set_progress_handler(None, 100)
        written = conn.execute("SELECT count(*) FROM writes").fetchone()[0]
    assert len(got) == 1
    return steps[0], written


def test_the_expiry_sweep_reads_and_rewrites_only_the_expired_leases(tmp_path):
    costs = {}
    for leased in (300, 3000):
        with SQLiteStore(tmp_path / f"{leased}.db") as store:
            _fill(store, leased, expired=3)
            costs[leased] = _one_lease_cost(store)
            by_status = {}
            for e in store.queue_entries():
                by_status[e.status] = by_status.get(e.status, 0) + 1
            assert by_status == {QueueStatus.LEASED: leased + 1, QueueStatus.QUEUED: 3}
    # the three expired tries re-queued, one try leased: 4 rows written, whatever is held
    assert costs[300][1] == costs[3000][1] == 4
    # ten times the tries in flight, about the same work (a scan of the leased rows is ten times the work)
    assert costs[3000][0] < 1.5 * costs[300][0], costs


def test_a_wait_out_of_range_is_refused_naming_it(store):
    with pytest.raises(ConfigurationError, match=r"wait=-1.*wait=5"):
        store.lease("r", wait=-1)
    with pytest.raises(ConfigurationError, match=r"lease_seconds=0\b"):
        store.lease("r", lease_seconds=0)


def test_a_waiting_lease_answers_when_a_try_is_queued_or_empty_after_its_wait(store):
    started = time.monotonic()
    assert store.lease("idle", wait=1.0) == []
    assert time.monotonic() - started >= 0.9

    threading.Timer(0.3, lambda: store.enqueue({"q": "late"}, n=1)).start()
    started = time.monotonic()
    (got,) = store.lease("waiting", wait=10.0)
    assert got.task == {"q": "late"} and got.runner == "waiting"
    assert time.monotonic() - started < 3.0  # woken by the enqueue, not by the end of the wait


def test_a_waiting_lease_on_sqlite_sees_another_process_enqueue(tmp_path):
    with SQLiteStore(tmp_path / "q.db") as waiting, SQLiteStore(tmp_path / "q.db") as other:
        threading.Timer(0.3, lambda: other.enqueue({"q": "from elsewhere"}, n=1)).start()
        started = time.monotonic()
        (got,) = waiting.lease("waiting", wait=10.0)  # no bell rings here: the file is read, with a back-off
        assert got.task == {"q": "from elsewhere"}
        assert time.monotonic() - started < 3.0


def test_a_waiting_lease_on_postgresql_is_woken_by_another_process_enqueue(pg_url, monkeypatch):
    monkeypatch.setattr(task_queue, "RECHECK", 60.0)  # nothing but the NOTIFY can wake it within the test
    with PostgresStore(pg_url, retry_for=5.0) as waiting, PostgresStore(pg_url, retry_for=5.0) as other:
        assert waiting.lease("warm", wait=0.2) == []  # its LISTEN connection is up
        threading.Timer(0.3, lambda: other.enqueue({"q": "notified"}, n=1)).start()
        started = time.monotonic()
        (got,) = waiting.lease("waiting", wait=10.0)
        assert got.task == {"q": "notified"}
        assert time.monotonic() - started < 5.0


def _lease_requests() -> int:
    return diagnostics.counters().get("store_server_lease_requests", 0)


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_an_idle_runner_asks_at_most_once_a_second_and_takes_a_queued_try_at_once(db, request, tmp_path):
    target = str(tmp_path / "served.db") if db == "sqlite" else request.getfixturevalue("pg_url")
    with BackgroundServer(target) as server:
        client = HttpStore(server.url, spill_dir=tmp_path / "spill", retry_for=5.0)
        ran: list[float] = []
        with Runner(client, lambda task: ran.append(time.monotonic()), concurrency=2, wait=5.0,
                    rollout_timeout=10) as runner:
            before = _lease_requests()
            started = time.monotonic()
            assert runner.serve(idle_exit=3.0) == 0
            idle = time.monotonic() - started
            asked = _lease_requests() - before
            assert asked <= idle + 1, (asked, idle)  # the old runner asked 20 times a second

            done = threading.Thread(target=runner.serve, kwargs=dict(max_rollouts=1))
            done.start()
            time.sleep(1.5)  # the runner waits in the server
            queued = time.monotonic()
            group = client.enqueue({"q": 1}, n=1)[0].group_id
            done.join(20)
            assert not done.is_alive() and len(ran) == 1
            assert ran[0] - queued < 1.0  # leased and started at once, not after the wait
            assert [e.status for e in client.queue_entries([group])] == [QueueStatus.DONE]
        client.close()


def test_the_runner_command_takes_wait_and_poll():
    from click.testing import CliRunner

    from lightning_rl.cli import main

    helped = CliRunner().invoke(main, ["runner", "--help"])
    assert "--wait" in helped.output and "--poll" in helped.output
    refused = CliRunner().invoke(main, ["runner", "--agent", "tests.store.server_agents:add", "--wait", "-1"])
    assert refused.exit_code != 0 and "--wait" in refused.output


def test_a_store_server_holds_a_waiting_lease_and_answers_other_requests_meanwhile(tmp_path):
    with BackgroundServer(tmp_path / "served.db") as server:
        client = HttpStore(server.url, spill_dir=tmp_path / "spill", retry_for=5.0)
        waiters = [threading.Thread(target=client.lease, args=(f"idle-{i}",), kwargs=dict(wait=60.0))
                   for i in range(60)]  # more than the server's default thread pool (40)
        for w in waiters:
            w.start()
        time.sleep(0.5)
        # answered while every lease still waits (they wait a minute: no clock decides it, on a loaded machine)
        assert httpx.post(f"{server.url}/v1/queue/entries", json={"group_ids": None}, timeout=50).status_code == 200
        assert all(w.is_alive() for w in waiters)
        client.enqueue({"x": 1}, n=60)  # a try for each: the waiting leases take them and return
        for w in waiters:
            w.join(60)
        assert not any(w.is_alive() for w in waiters)
        client.close()


def test_the_fleet_queue_benchmark_runs_quick_and_reports_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_fleet_queue.py"), "--quick",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=180, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["store"] for r in rows} == {"sqlite", "1 server (sqlite)"}
    assert all(r["completed"] > 0 and r["completed"] == r["leased"] == r["leases"] for r in rows), rows
    assert all(r["errors"] == 0 and r["ran_dry_after_s"] is None and r["spare"] == 5000 for r in rows), rows
    (runner,) = [r for r in rows if "idle_requests_per_s" in r]
    assert runner["enqueue_to_start_ms"] > 0
    assert set(result["p50_ratio_largest_to_smallest"]) == {"sqlite, 2 procs, new", "1 server (sqlite), 2 procs, new"}


def test_a_fleet_queue_bench_whose_queue_runs_dry_says_so_and_times_no_empty_leases(tmp_path):
    """CI, a fast machine: the quick run's spare queue (then 1,400 tries) ran out, and the empty leases
    after it were timed and counted as leases that got no try."""
    out = tmp_path / "bench.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_fleet_queue.py"), "--quick",
                           "--spare-per-s", "0", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    small = [r for r in rows if r["in_flight"] == 200]  # 100 queued and no spare, for 0.5 s
    assert len(small) == 2 and all(r["spare"] == 0 for r in small)
    for r in small:
        assert r["leased"] == r["completed"] <= 100 and r["errors"] == 0, r
        warned = f"{r['store']}, new, 2 processes, 200 in flight: the queue ran dry" in done.stderr
        if r["ran_dry_after_s"] is None:  # the server on a loaded machine may not empty it in 0.5 s
            assert r["leases"] == r["leased"] and not warned, r
        else:
            assert r["leased"] == 100 and 0 <= r["ran_dry_after_s"] < 0.5 and warned, r
            assert r["leased"] < r["leases"] <= r["leased"] + 2, r  # one empty lease a process, then it stops
    # one SQLite file takes hundreds of tries a second even on a loaded machine: it runs dry
    assert [r for r in small if r["store"] == "sqlite"][0]["ran_dry_after_s"] is not None
