"""``lightning-rl store serve|migrate|doctor`` and ``runner`` over PostgreSQL, run as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl.cli import main
from lightning_rl.records import RolloutStatus
from lightning_rl.store import wait_for_groups, wire
from lightning_rl.store.http.client import HttpStore
from lightning_rl.store.ops import StartRollout
from lightning_rl.store.postgres.schema import latest_version
from lightning_rl.store.postgres.store import PostgresStore

from ..services import wait_healthy
from .helpers import rollout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(db: str, env: dict) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db", db, "--port",
                             str(port), "--workers", "1"], env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, what="the store server")
    return proc, url


def test_servers_over_postgresql_serve_runners_given_every_url(pg_url, tmp_path):
    env = dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path / "spill"))
    (one, url_one), (two, url_two) = _serve(pg_url, env), _serve(pg_url, env)
    try:
        health = httpx.get(f"{url_one}/v1/health").json()
        assert health["synchronous"] is None and health["store"].startswith("postgresql://")
        client = HttpStore([url_one, url_two], spill_dir=tmp_path / "spill-test")
        group = client.enqueue({"a": 2, "b": 3}, n=4)[0].group_id
        os.killpg(one.pid, signal.SIGKILL)  # the first server is gone before the runner starts
        one.wait(30)
        done = subprocess.run(
            [sys.executable, "-m", "lightning_rl.cli", "runner", "--agent", "tests.store.server_agents:add",
             "--store", f"{url_one},{url_two}", "--concurrency", "2", "--max-rollouts", "4", "--report",
             str(tmp_path / "report.json")], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert wait_for_groups(client, [group], timeout=10)
        counters = json.loads((tmp_path / "report.json").read_text())["counters"]
        assert counters.get("store_server_failovers", 0) >= 1 and not counters.get("spilled_ops")
        client.close()
    finally:
        for proc in (one, two):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
    with PostgresStore(pg_url, read_only=True) as db:
        trajs = list(lrl.trajectories(db))
        assert len(trajs) == 4 and all(t.final_reward == 1.0 and len(t.tool_spans) == 1 for t in trajs)


def test_serve_refuses_what_is_not_a_served_store(pg_url):
    runner = CliRunner()
    sync = runner.invoke(main, ["store", "serve", "--db", pg_url, "--synchronous", "normal"])
    assert sync.exit_code == 1 and "--synchronous is SQLite's" in sync.output and "Traceback" not in sync.output
    memory = runner.invoke(main, ["store", "serve", "--db", "memory://"])
    assert memory.exit_code == 1 and "'memory://' is not a SQLite file or a postgresql:// URL" in memory.output
    helped = runner.invoke(main, ["store", "serve", "--help"])
    assert "postgresql://" in helped.output and "LIGHTNING_RL_STORE=http://a:8765,http://b:8765" in helped.output


def test_migrate_over_postgresql_says_from_which_schema(pg_url):
    runner = CliRunner()
    first = runner.invoke(main, ["store", "migrate", "--store", pg_url])
    assert first.exit_code == 0, first.output
    assert f"a new store, created with schema {latest_version()}" in first.output
    again = runner.invoke(main, ["store", "migrate", "--store", pg_url])
    assert again.exit_code == 0 and f"schema {latest_version()}, up to date" in again.output
    vacuum = runner.invoke(main, ["store", "migrate", "--store", pg_url, "--vacuum"])
    assert vacuum.exit_code == 1 and "--vacuum is SQLite's" in vacuum.output


def test_doctor_over_postgresql_lists_spill_files_it_does_not_replay(pg_url, tmp_path, monkeypatch):
    spill = tmp_path / "spill"
    monkeypatch.setenv("LIGHTNING_RL_SPILL_DIR", str(spill))
    env = dict(os.environ)
    PostgresStore(pg_url).close()  # the store exists
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    spill.mkdir()
    left = spill / f"{time.time_ns():020d}-{dead.pid}.jsonl"  # what a writer killed while the database was away leaves
    left.write_bytes(wire.encode(StartRollout(rollout("from-spill"))) + b"\n")

    def doctor() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lightning_rl.cli", "store", "doctor", "--store", pg_url, "--json"],
                              env=env, capture_output=True, text=True, timeout=60)

    found = doctor()
    assert found.returncode == 1, found.stderr
    report = json.loads(found.stdout)
    assert report["spill_files"] == 1 and report["spill"] == [str(left)] and report["quarantined"] == 0
    assert left.exists()  # listed, not replayed
    with PostgresStore(pg_url) as store:  # a writer opening the store adopts and replays it
        assert store.flush(10) and store.spill_files == []
        assert store.get_rollout("from-spill").status == RolloutStatus.RUNNING
    clean = doctor()
    assert clean.returncode == 0 and json.loads(clean.stdout)["spill_files"] == 0


def test_the_gateway_given_two_servers_records_through_the_one_alive(pg_url, tmp_path):
    from lightning_rl.serving import ServerThread
    from tests.gateway.test_upstreams import fake_engine

    env = dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path / "spill"))
    (one, url_one), (two, url_two) = _serve(pg_url, env), _serve(pg_url, env)
    engine = ServerThread(fake_engine("a", []), name="fake-a")
    engine.start("a fake engine")
    port = _free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "gateway", "--upstream", engine.url,
                                "--store", f"{url_one},{url_two}", "--port", str(port)], env=env,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, gateway, what="the gateway")
        os.killpg(one.pid, signal.SIGKILL)  # the gateway's first server is gone
        one.wait(30)
        opened = httpx.post(f"{url}/v1/rollouts", json={"task": {"q": 1}}).json()
        answer = httpx.post(opened["base_url"] + "/chat/completions", timeout=10,
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        assert httpx.post(f"{url}/v1/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0}).status_code == 200
        with PostgresStore(pg_url, read_only=True) as db:
            deadline = time.monotonic() + 30
            while opened["rollout_id"] not in db.existing_rollout_ids([opened["rollout_id"]]) or \
                    db.get_rollout(opened["rollout_id"]).status == RolloutStatus.RUNNING:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            traj = lrl.trajectory(db, opened["rollout_id"])
        assert traj.status == RolloutStatus.SUCCEEDED and len(traj.llm_calls) == 1 and traj.final_reward == 1.0
        assert not list((tmp_path / "spill").glob("*.jsonl"))  # it moved to the other server, nothing spilled
    finally:
        for proc in (gateway, one, two):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
        engine.stop()


def test_a_server_killed_with_sigkill_takes_its_workers_with_it(pg_url, tmp_path):
    """A user trial: `kill -9 <store serve pid>` (what docs/fleet.md says) left its two workers answering on
    the port for minutes, holding database connections, so clients never failed over."""
    env = dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path / "spill"))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db", pg_url, "--port",
                             str(port), "--workers", "2"], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, what="the store server")
    proc.kill()  # SIGKILL to the supervisor alone, not its process group
    proc.wait(30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/v1/health", timeout=1)
        except httpx.HTTPError:
            break  # nothing answers on the port any more
        time.sleep(0.2)
    else:
        raise AssertionError("the killed server's workers still answer")


def test_a_server_on_a_busy_port_says_so_before_it_says_it_is_serving(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db",
                               str(tmp_path / "s.db"), "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and not done.stderr.startswith("serving")
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
