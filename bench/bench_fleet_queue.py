#!/usr/bin/env python
"""The task queue at fleet size: one lease's p50/p99 and lease+complete throughput with 1,000 and 100,000
tries in flight and 8 / 64 leasing processes, the requests an idle runner sends a second, and the time from
an enqueue to a waiting runner starting the try; this code against the queue before issue 44, in one run.

"In flight" = leased and not completed (half, held by a runner that never completes them) plus queued
(the other half), and behind them a spare queue for the run, ``--spare-per-s`` (10,000) tries a second
times the seconds, recorded as the row's ``spare``; the leasing processes take and complete tries from
the queued ones. A queue that runs dry anyway is reported (``ran_dry_after_s``, a warning), never timed
as empty leases. Three stores:
a SQLite file opened by every process; one ``lightning-rl store serve`` over SQLite; two store servers
over one PostgreSQL database (a throwaway cluster, fsync on: ``_postgres.py``), each process given both.

The baseline is the queue's code before issue 44 (every lease reads every leased row and sweeps expiries
in Python, on the leasing process's clock; runners poll every 50 ms): that commit (``--baseline-ref``, by
default the parent of the commit that added this file, else HEAD) is checked out in a ``git worktree``
under ``.cache/`` and every configuration runs from both trees in the same run, alternating. Each tree
runs in a driver process of its own (``--driver``) that imports lightning-rl once and forks its leasing
processes.

Goals (issue 44): p50 of one lease at 100,000 in flight within 1.3x of p50 at 1,000; an idle runner sends
<= 1 request a second; a queued try is leased within 100 ms when a runner is free.

    python bench/bench_fleet_queue.py [--seconds 4] [--json-out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import atexit
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

STORES = ("sqlite", "1 server (sqlite)", "2 servers (postgres)")
SPARE_PER_S = 10_000  # tries a second the spare queue is sized for, at least (``--spare-per-s``)


# -- the driver: runs in one tree (this one or the baseline's), prints a JSON line -------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(db: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db", db, "--port",
                             str(port), "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the store server over {db} did not start")


def _fill(db: str, in_flight: int, spare: int) -> None:
    """Half of ``in_flight`` leased to a runner that never completes them (for a day), half queued, and
    ``spare`` more queued for the leasing processes to take; written straight into the tables."""
    from lightning_rl.records import QueueEntry, QueueStatus
    from lightning_rl.store.rows import QUEUE_COLUMNS, queue_values
    from lightning_rl.store.uri import open_store

    open_store(db).close()  # the schema, as this tree's code makes it
    group, now = uuid.uuid4().hex, time.time()
    rows = []
    for i in range(in_flight + spare):
        held = i < in_flight // 2
        rows.append(queue_values(QueueEntry(
            queue_id=uuid.uuid4().hex, group_id=group, task={"i": i}, attempt=i, created=now + i * 1e-6,
            status=QueueStatus.LEASED if held else QueueStatus.QUEUED, runner="holder" if held else None,
            lease_expires=now + 86_400 if held else None, tries=1 if held else 0,
            rollout_id=uuid.uuid4().hex if held else None, lease_key="k" if held else None)))
    cols = ", ".join(QUEUE_COLUMNS)
    if db.startswith("postgresql"):
        import psycopg

        try:
            from lightning_rl.store.postgres.store import parse_url
        except ImportError:  # the baseline's tree (module doc): before the store moved to store/postgres/
            from lightning_rl.store.postgres_store import parse_url

        conninfo, schema, _ = parse_url(db)
        with psycopg.connect(conninfo, options=f"-c search_path={schema}") as conn, conn.cursor() as cur:
            with cur.copy(f"COPY queue ({cols}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            cur.execute("ANALYZE queue")
    else:
        import sqlite3

        with sqlite3.connect(db.removeprefix("sqlite:///")) as conn:
            conn.executemany(f"INSERT INTO queue ({cols}) VALUES ({', '.join('?' * len(QUEUE_COLUMNS))})", rows)


def _http_store() -> type:
    """The HTTP store client, in either tree: the baseline's (module doc) is from before it moved to store/http/."""
    try:
        from lightning_rl.store.http.client import HttpStore
    except ImportError:
        from lightning_rl.store.http_store import HttpStore
    return HttpStore


def _worker(urls: list[str], index: int, seconds: float, start: float, out: mp.Queue) -> None:
    from lightning_rl.records import RolloutStatus
    from lightning_rl.store.uri import open_store

    if urls[0].startswith("http"):
        HttpStore = _http_store()

        store = HttpStore(urls[index % len(urls):] + urls[:index % len(urls)], retry_for=60.0,
                          spill_dir=tempfile.mkdtemp(prefix="bench-queue-spill-"))
    else:
        store = open_store(urls[0])
    runner = f"bench-{index}"
    lease_ms: list[float] = []
    done = leased = 0
    dry_at: float | None = None
    errors: list[str] = []
    try:
        store.heartbeat("warm-up", runner)  # connections made before the clock starts
    except Exception as exc:  # the old queue's server at 100,000 in flight and 64 processes may not answer
        errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    time.sleep(max(0.0, start - time.time()))
    end = start + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        try:
            got = store.lease(runner, lease_seconds=600, limit=1)
            lease_ms.append((time.perf_counter() - t0) * 1e3)
            if not got:  # the spare queue is spent: what follows would time empty leases
                dry_at = time.time() - start
                break
            leased += len(got)
            for entry in got:
                done += store.complete(entry.queue_id, runner, RolloutStatus.SUCCEEDED)
        except Exception as exc:  # the old queue at 100,000 in flight: "database is locked" after 30 s
            errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    try:
        store.close()
    finally:
        out.put((lease_ms, done, errors, leased, dry_at))


def _measure(urls: list[str], processes: int, seconds: float) -> dict:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    start = time.time() + 1.0 + processes * 0.05
    procs = [ctx.Process(target=_worker, args=(urls, i, seconds, start, out)) for i in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join(30)
    lease_ms = sorted(ms for r in results for ms in r[0])
    done = sum(r[1] for r in results)
    errors = [e for r in results for e in r[2]]
    dry = [r[4] for r in results if r[4] is not None]
    return {"leases": len(lease_ms), "leased": sum(r[3] for r in results), "completed": done,
            "per_s": done / seconds, "errors": len(errors),
            "ran_dry_after_s": min(dry) if dry else None,  # then per_s is a lower bound (main warns)
            "first_error": errors[0] if errors else None,
            "p50_ms": statistics.median(lease_ms) if lease_ms else None,
            "p99_ms": lease_ms[min(len(lease_ms) - 1, int(len(lease_ms) * 0.99))] if lease_ms else None}


def _runner_figures(url: str, idle_seconds: float) -> dict:
    """An idle runner's lease requests a second (counted at the client), and enqueue to start of the try."""
    from lightning_rl.trainer_bridge.runner import Runner

    HttpStore = _http_store()

    sent = [0]
    real = HttpStore._request

    def counted(self, method, path, **kw):
        sent[0] += path == "/queue/lease"
        return real(self, method, path, **kw)

    HttpStore._request = counted
    store = HttpStore(url, retry_for=30.0, spill_dir=tempfile.mkdtemp(prefix="bench-queue-spill-"))
    started: list[float] = []
    with Runner(store, lambda task: started.append(time.time()), concurrency=1, rollout_timeout=30) as runner:
        worker = threading.Thread(target=runner.serve, daemon=True)
        worker.start()
        time.sleep(1.0)
        before = sent[0]
        time.sleep(idle_seconds)
        idle_rate = (sent[0] - before) / idle_seconds
        latencies = []
        for i in range(5):
            time.sleep(0.3 + 0.07 * i)  # at different moments of the runner's wait or poll
            queued = time.time()
            store.enqueue({"i": i}, n=1)
            while len(started) <= i:
                time.sleep(0.001)
            latencies.append((started[i] - queued) * 1e3)
        runner.stop()
        worker.join(30)
    store.close()
    HttpStore._request = real
    return {"idle_requests_per_s": idle_rate, "enqueue_to_start_ms": statistics.median(latencies),
            "enqueue_to_start_max_ms": max(latencies)}


def driver(args: argparse.Namespace) -> None:
    plan = json.loads(args.driver)
    results = []
    work = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    for config in plan["configs"]:
        store, in_flight, processes = config["store"], config["in_flight"], config["processes"]
        # 2 processes on one SQLite file took ~2,800 tries a second on this 2-core machine (2026-11-29)
        spare = int(plan["seconds"] * plan["spare_per_s"])
        servers: list[subprocess.Popen] = []
        if store == "sqlite":
            db = f"sqlite:///{work / uuid.uuid4().hex}.db"
            _fill(db, in_flight, spare)
            urls = [db]
        elif store == "1 server (sqlite)":
            db = str(work / f"{uuid.uuid4().hex}.db")
            _fill(f"sqlite:///{db}", in_flight, spare)
            proc, url = _serve(db)
            servers, urls = [proc], [url]
        else:
            db = config["pg_url"]
            _fill(db, in_flight, spare)
            started = [_serve(db) for _ in range(2)]
            servers, urls = [p for p, _ in started], [u for _, u in started]
        try:
            row = dict(config, spare=spare, **_measure(urls, processes, plan["seconds"]))
            if config.get("runner"):  # an idle runner on a store of its own, with an empty queue
                empty = config.get("runner_pg_url") or str(work / f"{uuid.uuid4().hex}.db")
                proc, url = _serve(empty)
                servers.append(proc)
                row.update(_runner_figures(url, plan["idle_seconds"]))
        finally:
            for proc in servers:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
        row.pop("runner_pg_url", None)
        row.pop("pg_url", None)
        results.append(row)
        print(json.dumps({"progress": row}), file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results))


# -- the main process: the baseline's tree, the cluster, the table ---------------------------------------
def _baseline_tree(ref: str | None) -> Path:
    if ref is None:
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "bench/bench_fleet_queue.py"],
                               cwd=ROOT, capture_output=True, text=True).stdout.split()
        ref = f"{added[-1]}^" if added else "HEAD"
    tree = ROOT / ".cache" / f"bench-queue-baseline-{os.getpid()}"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=ROOT, check=True,
                   capture_output=True)
    atexit.register(lambda: subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                                           capture_output=True))
    return tree


def _run_driver(tree: Path, plan: dict) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--driver", json.dumps(plan)], cwd=tree,
                          env=env, stdout=subprocess.PIPE, text=True)  # its progress lines on our stderr
    if done.returncode != 0:
        raise RuntimeError(f"the driver in {tree} failed (exit {done.returncode}; its stderr is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="leasing time of each configuration")
    parser.add_argument("--in-flight", default="1000,100000")
    parser.add_argument("--processes", default="8,64")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--baseline-ref", default=None, help="the commit of the old queue (module doc)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run in seconds: small, this tree, SQLite only")
    parser.add_argument("--spare-per-s", type=int, default=SPARE_PER_S,
                        help="size the queued spare for this many tries a second in all, at least")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        return driver(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the worktree and the cluster go at exit
    if args.quick:
        args.seconds, args.in_flight, args.processes, args.idle_seconds = 0.5, "200,2000", "2", 1.0
        args.stores, args.no_baseline = "sqlite,1 server (sqlite)", True
    stores = [s for s in args.stores.split(",") if s]
    sizes = [int(x) for x in args.in_flight.split(",")]
    counts = [int(x) for x in args.processes.split(",")]
    trees = {"new": ROOT} if args.no_baseline else {"new": ROOT, "old": _baseline_tree(args.baseline_ref)}
    cluster = None
    if any("postgres" in s for s in stores):
        from _postgres import start_cluster

        cluster = start_cluster("bench-queue-pg")
    rows: list[dict] = []
    plans: list[tuple[Path, list[dict]]] = []
    for store in stores:
        for processes in counts:
            for in_flight in sizes:
                for code, tree in trees.items():  # the two codes alternate, configuration by configuration
                    config = {"store": store, "in_flight": in_flight, "processes": processes, "code": code,
                              "runner": in_flight == sizes[0] and processes == counts[0] and store != "sqlite"}
                    if cluster is not None and "postgres" in store:
                        config["pg_url"] = cluster.create_database()
                        if config["runner"]:
                            config["runner_pg_url"] = cluster.create_database()
                    plans.append((tree, [config]))
    if args.quick:  # one driver for everything: a smoke run is mostly start-up
        plans = [(ROOT, [c for _, configs in plans for c in configs])]
    for tree, configs in plans:
        rows.extend(_run_driver(tree, {"configs": configs, "seconds": args.seconds,
                                       "idle_seconds": args.idle_seconds, "spare_per_s": args.spare_per_s}))
    print(f"\n{'store':22} {'code':4} {'procs':>5} {'in flight':>9} {'lease p50':>10} {'lease p99':>10} "
          f"{'tries/s':>8} {'idle req/s':>10} {'enq->start':>10}")
    for r in rows:
        idle = f"{r['idle_requests_per_s']:.2f}" if "idle_requests_per_s" in r else ""
        lat = f"{r['enqueue_to_start_ms']:.0f} ms" if "enqueue_to_start_ms" in r else ""
        print(f"{r['store']:22} {r['code']:4} {r['processes']:5} {r['in_flight']:9} {r['p50_ms'] or 0:8.1f}ms "
              f"{r['p99_ms'] or 0:8.1f}ms {r['per_s']:8.0f} {idle:>10} {lat:>10}")
    for r in rows:
        if r["ran_dry_after_s"] is not None:
            print(f"WARNING: {r['store']}, {r['code']}, {r['processes']} processes, {r['in_flight']:,} in flight: "
                  f"the queue ran dry {r['ran_dry_after_s']:.2f} s into the {args.seconds} s run, so its tries/s is a "
                  f"lower bound; raise --spare-per-s above {r['per_s']:.0f}", file=sys.stderr)
    ratios = {}
    for store in stores:
        for processes in counts:
            for code in trees:
                p50 = {r["in_flight"]: r["p50_ms"] for r in rows
                       if (r["store"], r["processes"], r["code"]) == (store, processes, code)}
                if len(sizes) > 1 and p50.get(sizes[0]) and p50.get(sizes[-1]):
                    ratios[f"{store}, {processes} procs, {code}"] = p50[sizes[-1]] / p50[sizes[0]]
    print(f"\np50 at {sizes[-1]:,} / p50 at {sizes[0]:,} in flight (goal <= 1.3 for the new code):")
    for name, ratio in ratios.items():
        print(f"  {name:45} {ratio:6.2f}x")
    result = {"bench": "fleet_queue", "date": time.strftime("%Y-%m-%d"), "seconds": args.seconds, "rows": rows,
              "p50_ratio_largest_to_smallest": ratios}
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
