"""The queue across machines: runners leasing through two store servers and straight from PostgreSQL
never lease the same try twice, and expired leases are retried (``FOR UPDATE SKIP LOCKED`` in the
database; the servers hold nothing of the queue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from lightning_rl.records import QueueStatus, RolloutStatus
from lightning_rl.store import wait_for_groups
from lightning_rl.store.postgres.store import PostgresStore

from .conftest import ROOT, ServerProcess, free_port, start_runner, write_figures

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def test_leases_through_two_servers_and_directly_never_hand_out_a_try_twice(pg_url, spill_env, tmp_path):
    """Six processes lease as fast as they can (two through each server, two straight from the database)
    and never complete: every entry is leased once per try, expires, and is leased again, max_tries times."""
    one, two = ServerProcess(pg_url, free_port()).start(), ServerProcess(pg_url, free_port()).start()
    try:
        with PostgresStore(pg_url) as db:
            entries = db.enqueue({"q": 1}, n=30, max_tries=3)
        group = entries[0].group_id
        stores = [f"{one.url},{two.url}", f"{two.url},{one.url}", pg_url] * 2
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "reliability" / "lease_loop.py"), url, group,
                                   f"leaser-{k}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=spill_env, cwd=ROOT) for k, url in enumerate(stores)]
        leases = []
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-2000:]
            leases += [tuple(json.loads(line)) for line in out.splitlines()]
        wall = time.monotonic() - t0
        with PostgresStore(pg_url, read_only=True) as db:
            final = db.queue_entries([group])
    finally:
        one.stop()
        two.stop()
    tries = Counter((queue_id, n) for queue_id, n, _ in leases)
    expected = {(e.queue_id, n) for e in entries for n in (1, 2, 3)}
    figures = {"leasing_processes": len(procs), "entries": len(entries), "max_tries": 3, "leases": len(leases),
               "leased_twice": sum(1 for c in tries.values() if c > 1), "wall_s": round(wall, 1),
               "rollout_ids_distinct": len({r for _, _, r in leases})}
    write_figures("fleet_leases", figures)
    assert figures["leased_twice"] == 0 and set(tries) == expected  # each try once, every retry given
    assert figures["rollout_ids_distinct"] == len(leases)
    assert all(e.status == QueueStatus.DONE and e.outcome == RolloutStatus.TIMED_OUT and e.tries == 3 for e in final)


def test_runners_on_two_servers_and_direct_run_each_try_once_and_retry_a_dead_runners(pg_url, spill_env, tmp_path):
    one, two = ServerProcess(pg_url, free_port()).start(), ServerProcess(pg_url, free_port()).start()
    runners: list[subprocess.Popen] = []
    try:
        go = tmp_path / "go"  # each try waits for it once its spans are written: held in flight until then
        with PostgresStore(pg_url) as db:
            groups = [db.enqueue({"spans": 3, "sleep": 0.1, "i": i, "until": str(go)}, n=2, max_tries=3)[0].group_id
                      for i in range(30)]
        victim = start_runner(one.url, spill_env, tmp_path / "victim.json", concurrency=4, lease_seconds=2)
        with PostgresStore(pg_url, read_only=True) as db:  # wait until the victim is mid-try
            deadline = time.monotonic() + 60
            while not [r for r in db.rollouts(status="running") if len(db.spans(r.rollout_id)) >= 1]:
                assert time.monotonic() < deadline and victim.poll() is None
                time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)  # its leases expire in 2 s; the others retry its tries
        victim.wait(30)
        stores = [f"{one.url},{two.url}", f"{two.url},{one.url}", pg_url]
        reports = [tmp_path / f"runner-{k}.json" for k in range(len(stores))]
        runners = [start_runner(url, spill_env, report, idle_exit=5) for url, report in zip(stores, reports)]
        # every way of reaching the queue takes part: the tries are released once each runner holds a lease (a
        # runner that started late on a loaded machine once found the queue drained by the others)
        with PostgresStore(pg_url, read_only=True) as db:
            deadline = time.monotonic() + 120
            while not all(any((e.runner or "").startswith(f"runner-{proc.pid}-") for e in db.queue_entries(groups))
                          for proc in runners):
                assert time.monotonic() < deadline and all(proc.poll() is None for proc in runners)
                time.sleep(0.1)
        go.touch()
        for proc in runners:
            assert proc.wait(300) == 0, proc.stderr.read()[-2000:]
        with PostgresStore(pg_url, read_only=True) as db:
            assert wait_for_groups(db, groups, timeout=10)
            entries = db.queue_entries(groups)
            rollouts = db.rollouts()
    finally:
        for proc in runners:
            if proc.poll() is None:
                proc.kill()
        one.stop()
        two.stop()
    ran = [json.loads(r.read_text())["ran"] for r in reports]
    per_try = Counter((r.group_id, r.attempt) for r in rollouts)
    succeeded = Counter((r.group_id, r.attempt) for r in rollouts if r.status == RolloutStatus.SUCCEEDED)
    expired = [r for r in rollouts if r.status == RolloutStatus.TIMED_OUT]
    by_victim = sum(1 for e in entries if (e.runner or "").startswith(f"runner-{victim.pid}-"))
    figures = {"runners": len(stores), "killed_runner": 1, "tries": len(entries), "ran_per_runner": ran,
               "completed_by_the_killed_runner": by_victim,
               "rollouts": len(rollouts), "expired_tries_retried": len(expired),
               "tries_leased_twice": sum(1 for c in succeeded.values() if c > 1)}
    write_figures("fleet_runners", figures)
    assert all(e.status == QueueStatus.DONE and e.outcome == RolloutStatus.SUCCEEDED for e in entries)
    assert set(succeeded.values()) == {1} and len(succeeded) == len(entries)  # each try succeeded once
    assert sum(ran) + by_victim == len(entries)  # run once: by the victim before it died, or by a runner alive
    assert expired and all("expired" in (r.error or "") for r in expired)
    assert {(e.group_id, e.attempt): e.tries for e in entries} == dict(per_try)  # one rollout per lease
    assert sum(1 for n in ran if n > 0) == len(stores)  # every way of reaching the queue took part
