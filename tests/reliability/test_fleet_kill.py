"""Two store servers over one PostgreSQL database, 8 writer processes given both URLs: one server killed
with SIGKILL mid-load, then (another test) the database itself killed and restarted mid-load. Every
rollout a writer saw acknowledged is in the database exactly once, whole (21 spans, 2 rewards,
succeeded), and nothing else is. Servers and writers are separate processes (`store serve`,
``fleet_writer.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from .conftest import ROOT, ServerProcess, free_port, write_figures

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

WRITERS = 8
SPANS = 21  # 20 tool spans and the rollout's own
REWARDS = 2  # "mid" (emitted) and "reward" (returned)


class Writers:
    """``fleet_writer.py`` processes; what each printed is read as it comes (acknowledged ids, counters)."""

    def __init__(self, orders: list[list[str]], tmp_path: Path, env: dict) -> None:
        self.stop_file = tmp_path / "stop"
        self.acked: list[tuple[float, int, str]] = []  # (when, writer, rollout id)
        self.counters: dict[int, dict] = {}  # writer -> what it printed last (its counters, the server it used last)
        self._lock = threading.Lock()
        self.procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "reliability" / "fleet_writer.py"), ",".join(urls),
             str(self.stop_file), f"w{k}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            for k, urls in enumerate(orders)]
        self._readers = [threading.Thread(target=self._read, args=(k, p), daemon=True) for k, p in enumerate(self.procs)]
        for reader in self._readers:
            reader.start()

    def _read(self, k: int, proc: subprocess.Popen) -> None:
        import json

        for line in proc.stdout:
            kind, _, rest = line.strip().partition(" ")
            with self._lock:
                if kind == "acked":
                    self.acked.append((time.monotonic(), k, rest))
                elif kind == "counters":
                    self.counters[k] = json.loads(rest)

    def count(self) -> int:
        with self._lock:
            return len(self.acked)

    def acked_by(self, k: int, since: float = 0.0) -> int:
        """How many rollouts writer ``k`` saw acknowledged at or after ``since`` (a ``time.monotonic()``)."""
        with self._lock:
            return sum(1 for when, writer, _ in self.acked if writer == k and when >= since)

    def wait_for(self, n: int, *, each: int = 0, since: float = 0.0, timeout: float = 180) -> None:
        """Until ``n`` rollouts in all were acknowledged and every writer saw ``each`` of its own acknowledged at or
        after ``since``: each writer is running, and has written through whatever happened at ``since``.
        ``timeout`` only guards against a hang; it is not what the test measures."""
        deadline = time.monotonic() + timeout
        while self.count() < n or any(self.acked_by(k, since) < each for k in range(len(self.procs))):
            assert time.monotonic() < deadline, (
                f"only {self.count()} rollouts acknowledged, waited for {n}; since {since:.1f}, each writer's: "
                f"{[self.acked_by(k, since) for k in range(len(self.procs))]}, waited for {each}")
            assert all(p.poll() is None for p in self.procs), self._errors()
            time.sleep(0.05)

    def finish(self) -> None:
        self.stop_file.touch()
        for proc in self.procs:
            assert proc.wait(300) == 0, self._errors()
        for reader in self._readers:
            reader.join(30)
        assert len(self.counters) == len(self.procs)

    def _errors(self) -> str:
        return "\n".join((p.stderr.read() or "")[-2000:] for p in self.procs if p.poll() not in (None, 0))

    def total(self, name: str) -> int:
        return sum(c.get(name, 0) for c in self.counters.values())

    def longest_wait(self) -> float:
        """The longest any writer waited between two acknowledged rollouts (what the fault cost an agent)."""
        longest = 0.0
        for k in range(len(self.procs)):
            times = [t for t, writer, _ in self.acked if writer == k]
            longest = max([longest, *(b - a for a, b in zip(times, times[1:]))])
        return longest


def _stored(pg_url: str) -> dict[str, tuple]:
    """Per rollout, straight from the database: (status, spans, distinct span ids, rewards, distinct reward
    names); and the quarantine's size under the key None."""
    import psycopg

    from lightning_rl.store.postgres.store import parse_url

    conninfo, schema, _ = parse_url(pg_url)
    with psycopg.connect(conninfo, options=f"-c search_path={schema}") as conn:
        status = dict(conn.execute("SELECT rollout_id, status FROM rollouts").fetchall())
        spans = {r: (n, d) for r, n, d in conn.execute(
            "SELECT rollout_id, COUNT(*), COUNT(DISTINCT span_id) FROM spans GROUP BY rollout_id")}
        rewards = {r: (n, d) for r, n, d in conn.execute(
            "SELECT rollout_id, COUNT(*), COUNT(DISTINCT name) FROM rewards GROUP BY rollout_id")}
        quarantined = conn.execute("SELECT COUNT(*) FROM quarantine").fetchone()[0]
    found: dict = {r: (s, *spans.get(r, (0, 0)), *rewards.get(r, (0, 0))) for r, s in status.items()}
    found[None] = quarantined
    return found


def _check(pg_url: str, writers: Writers) -> dict:
    stored = _stored(pg_url)
    quarantined = stored.pop(None)
    acked = [rid for _, _, rid in writers.acked]
    whole = ("succeeded", SPANS, SPANS, REWARDS, REWARDS)
    return {
        "acknowledged": len(acked),
        "acknowledged_twice": len(acked) - len(set(acked)),
        "lost": sum(1 for rid in acked if rid not in stored),
        "incomplete_or_doubled": sum(1 for rid in acked if rid in stored and stored[rid] != whole),
        "stored_not_acknowledged": len(set(stored) - set(acked)),
        "quarantined": quarantined,
    }


def _orders(a: str, b: str) -> list[list[str]]:
    """Half the writers start on each server (the load is spread as a client list or a balancer would)."""
    return [[a, b] if k % 2 == 0 else [b, a] for k in range(WRITERS)]


def test_a_server_killed_mid_load_loses_and_doubles_nothing(pg_url, spill_env, tmp_path):
    one, two = ServerProcess(pg_url, free_port()).start(), ServerProcess(pg_url, free_port()).start()
    try:
        t0 = time.monotonic()
        orders = _orders(one.url, two.url)
        writers = Writers(orders, tmp_path, spill_env)
        writers.wait_for(80, each=3)  # every writer is writing, half of them to the server about to die
        before = writers.count()
        one.kill()  # SIGKILL: its in-flight batches are never acknowledged; the writers move to the other
        killed_at = time.monotonic()
        writers.wait_for(before + 160, each=3, since=killed_at)  # and every writer has written since
        after_kill = writers.count() - before
        writers.finish()
        wall = time.monotonic() - t0
    finally:
        one.kill()
        two.stop()
    result = _check(pg_url, writers)
    figures = {**result, "writers": WRITERS, "servers": 2, "acknowledged_before_kill": before,
               "acknowledged_after_kill": after_kill, "wall_s": round(wall, 1),
               "rollouts_per_s": round(result["acknowledged"] / wall, 1),
               "failovers": writers.total("store_server_failovers"), "spilled_ops": writers.total("spilled_ops"),
               "spill_files_replayed": writers.total("spill_files_replayed"),
               "longest_wait_of_a_writer_s": round(writers.longest_wait(), 2)}
    write_figures("fleet_server_kill9", figures)
    assert result["lost"] == 0 and result["incomplete_or_doubled"] == 0 and result["acknowledged_twice"] == 0
    assert result["stored_not_acknowledged"] == 0 and result["quarantined"] == 0
    # every writer that was using the killed server and wrote after its death moved to the other and stayed there
    # (all of them: each was waited for); a writer of the other server never needed to (none left a live server
    # for a dead one). How many moved is what the kill caused, not how the writers happened to be scheduled.
    on_killed = [k for k, urls in enumerate(orders) if urls[0] == one.url]
    assert [writers.counters[k].get("store_server_failovers", 0) >= 1 for k in on_killed] == [True] * len(on_killed)
    assert {c["server"] for c in writers.counters.values()} == {two.url}
    assert not list((tmp_path / "spill").glob("*.jsonl")) and not list((tmp_path / "spill").glob("rejected-*"))


def test_the_database_restarted_mid_load_clients_spill_then_replay(spill_env, tmp_path):
    from tests.pg_cluster import PostgresCluster

    cluster = PostgresCluster(ROOT / ".cache" / f"pg-restart-{os.getpid()}-{uuid.uuid4().hex[:8]}").start()
    servers: list[ServerProcess] = []
    try:
        pg_url = cluster.create_database()
        servers = [ServerProcess(pg_url, free_port()).start() for _ in range(2)]
        t0 = time.monotonic()
        writers = Writers(_orders(servers[0].url, servers[1].url), tmp_path, spill_env)
        writers.wait_for(80, each=3)
        before = writers.count()
        cluster.kill()  # an immediate shutdown, as a crash: no checkpoint, recovery from the WAL on start
        down_at = time.monotonic()
        # the database stays down until every writer has seen a rollout acknowledged without it (into its spill
        # file): each felt the outage, however slowly the machine runs, not only those scheduled in a fixed wait
        writers.wait_for(before, each=2, since=down_at + 0.5)
        during = writers.count() - before  # acknowledged into the writers' spill files
        cluster.start()
        up_at = time.monotonic()
        writers.wait_for(writers.count() + 160)
        writers.finish()
        wall = time.monotonic() - t0
        result = _check(pg_url, writers)
    finally:
        for server in servers:
            server.kill()
        cluster.destroy()
    figures = {**result, "writers": WRITERS, "servers": 2, "acknowledged_before_outage": before,
               "database_down_s": round(up_at - down_at, 1), "acknowledged_while_down": during,
               "wall_s": round(wall, 1), "spilled_ops": writers.total("spilled_ops"),
               "spill_files_replayed": writers.total("spill_files_replayed"),
               "failovers": writers.total("store_server_failovers"),
               "longest_wait_of_a_writer_s": round(writers.longest_wait(), 2)}
    write_figures("fleet_database_restart", figures)
    assert result["lost"] == 0 and result["incomplete_or_doubled"] == 0 and result["acknowledged_twice"] == 0
    assert result["stored_not_acknowledged"] == 0 and result["quarantined"] == 0
    # every writer wrote while the database was down (waited for), so each spilled, and replayed when it came back
    assert during > 0 and figures["spill_files_replayed"] > 0
    assert [c.get("spilled_ops", 0) > 0 for c in writers.counters.values()] == [True] * WRITERS
    assert not list((tmp_path / "spill").glob("*.jsonl")) and not list((tmp_path / "spill").glob("rejected-*"))
