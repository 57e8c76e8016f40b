#!/usr/bin/env python
"""Store servers over PostgreSQL: spans/s through 1 and 2 servers over one database, against 1 server over
SQLite, in one run, with the CPU per span of every process (servers, database, clients, the rest).

Four configurations, alternated in every round (the machine is shared and noisy), each from a fresh
database or file: ``lightning-rl store serve --db FILE`` (SQLite, synchronous=full, the default); one
store server over PostgreSQL; two of them over one database, the clients split between them; and two
servers of one worker each (as many processes as one server of two: what splitting costs apart from
adding processes). Every server is ``lightning-rl store serve --db FILE|postgresql://...`` with ``--workers``
processes. The PostgreSQL cluster is a throwaway one under ``.cache/``, with fsync on (a commit is on disk when
it returns, as SQLite's FULL).

The clients are ``bench_store_server.py``'s: N processes writing rollouts of 50 LLM spans (128 + 32 token
ids and log-probs) through ``HttpStore`` as the tracer does. Wall time runs from the moment all clients
are ready until the last one has its spans acknowledged; then the stored rows are counted (lost,
duplicated, unfinished rollouts). CPU comes from /proc: each server's processes, the PostgreSQL cluster
(postmaster and every backend, ended ones included), the clients' own process time, and the whole
machine, so that what other work took is shown too, and which ceiling a configuration hit: the
machine's cores, or one process.

Goals (issue 35): a server's CPU per span over PostgreSQL <= 1.2x the same server's over SQLite (same
run); two servers never slower than one.

    python bench/bench_pg_store_server.py [--clients 8] [--spans-per-client 5000] [--rounds 3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _postgres import cluster_cpu, machine_cpu, start_cluster, tree_cpu  # noqa: E402
from bench_store_server import _client, free_port, wait_ready  # noqa: E402

#: name: (database, servers, worker processes a server: None for --workers)
CONFIGS = {"sqlite, 1 server": ("sqlite", 1, None), "postgres, 1 server": ("postgres", 1, None),
           "postgres, 2 servers": ("postgres", 2, None), "postgres, 2 servers of 1 worker": ("postgres", 2, 1)}
CORES = os.cpu_count() or 1


def _start(kind: str, target: str, workers: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db", target, "--port", str(port),
            "--workers", str(workers)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL), f"http://127.0.0.1:{port}"


def wait_idle(pids: list[int], timeout: float = 60.0) -> None:
    """Until the servers' processes have done starting (every worker imported and connected): their CPU
    stays still for half a second, so that no start-up is counted as work."""
    deadline = time.monotonic() + timeout
    last = -1.0
    while time.monotonic() < deadline:
        now = sum(sum(tree_cpu(pid).values()) for pid in pids)
        if now - last < 0.02:
            return
        last = now
        time.sleep(0.5)


def _warm_client(url: str, index: int, *rest) -> None:
    """A client that first writes one rollout of its own (not counted), so that each server has its database
    connections, prepared statements and caches when the measurement starts, then runs as the others do."""
    import tempfile

    from lightning_rl.records import Rollout, RolloutStatus, SpanRow
    from lightning_rl.store.http.client import HttpStore

    store = HttpStore(url, spill_dir=tempfile.mkdtemp(prefix=f"bench-warm-{index}-"))
    store.start_rollout(Rollout(rollout_id=f"warm-{index}", name="bench"))
    for seq in range(50):
        store.write_span(SpanRow(rollout_id=f"warm-{index}", seq=seq, trace_id=1, span_id=seq + 1, parent_id=None,
                                 name="warm", kind="CLIENT", start_ns=1, end_ns=2, status_code="OK",
                                 status_message=None, attributes={}, events=(), tokens=None))
    store.finish_rollout(f"warm-{index}", RolloutStatus.SUCCEEDED, time.time(), None)
    store.close()
    _client(url, index, *rest)


def _stored(kind: str, target: str) -> tuple[int, int, int]:
    """(spans stored, distinct (rollout, seq), rollouts not succeeded), the warm-up rollouts left out."""
    spans_sql = ("SELECT COUNT(*), COUNT(DISTINCT rollout_id || ':' || seq) FROM spans "
                 "WHERE rollout_id NOT LIKE 'warm-%'")
    unfinished_sql = "SELECT COUNT(*) FROM rollouts WHERE status != 'succeeded'"
    if kind == "sqlite":
        conn = sqlite3.connect(target)
        try:
            return (*conn.execute(spans_sql).fetchone(), conn.execute(unfinished_sql).fetchone()[0])
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(target, options="-c search_path=lightning_rl") as conn:
        return (*conn.execute(spans_sql).fetchone(), conn.execute(unfinished_sql).fetchone()[0])


def _database_counters(target: str) -> dict[str, int]:
    """Write transactions (transaction ids given out, cluster-wide) and WAL bytes so far; exact at once,
    unlike pg_stat_* (which backends report up to seconds late). Reading them takes one id."""
    import psycopg

    with psycopg.connect(target, autocommit=True) as conn:
        xid, wal = conn.execute("SELECT pg_current_xact_id()::text::bigint, "
                                "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()
    return {"write_transactions": xid, "wal_bytes": wal}


def run_config(name: str, args: argparse.Namespace, cluster, work: Path) -> dict:
    kind, n_servers, workers = CONFIGS[name]
    if kind == "sqlite":
        target = str(work / f"served-{uuid.uuid4().hex[:8]}.db")
    else:
        target = cluster.create_database()
        from lightning_rl.store.postgres.store import PostgresStore

        PostgresStore(target).close()  # the schema, before the servers race to make it
    servers = [_start(kind, target, workers or args.workers) for _ in range(n_servers)]
    try:
        for _, url in servers:
            wait_ready(f"{url}/v1/health")
        wait_idle([s.pid for s, _ in servers])
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(args.clients + 1), ctx.Queue()
        procs = [ctx.Process(target=_warm_client, args=(servers[i % n_servers][1], i, args.spans_per_client,
                                                   args.prompt_tokens, args.response_tokens, args.batch_ops, barrier,
                                                   out)) for i in range(args.clients)]
        for p in procs:
            p.start()
        barrier.wait()
        t0 = time.perf_counter()
        counters0 = _database_counters(target) if kind == "postgres" else {}
        server_cpu0 = [tree_cpu(s.pid) for s, _ in servers]
        db0, machine0 = cluster_cpu(cluster), machine_cpu()
        results = [out.get(timeout=900) for _ in procs]
        wall = time.perf_counter() - t0
        server_cpu1 = [tree_cpu(s.pid) for s, _ in servers]
        db1, machine1 = cluster_cpu(cluster), machine_cpu()
        counters1 = _database_counters(target) if kind == "postgres" else {}
        for p in procs:
            p.join()
    finally:
        for server, _ in servers:
            server.terminate()
        for server, _ in servers:
            server.wait(30)
    stored, distinct, unfinished = _stored(kind, target)
    if kind == "postgres":  # no autovacuum of it to land on a later configuration's figures
        import psycopg

        with psycopg.connect(cluster.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{target.rsplit("/", 1)[1]}"')
    sent = args.clients * args.spans_per_client
    per_process = [{pid: c1.get(pid, 0.0) - c0.get(pid, 0.0) for pid in c1} for c0, c1 in zip(server_cpu0, server_cpu1)]
    servers_s = [sum(p.values()) for p in per_process]
    db_s, clients_s = db1 - db0, sum(r["cpu_s"] for r in results)
    busy_s = machine1[0] - machine0[0]
    latencies = sorted(x for r in results for x in r["latencies"])
    us = 1e6 / sent
    ours_us = (sum(servers_s) + db_s + clients_s) * us
    return {
        "config": name, "spans": sent, "stored": stored, "lost": sent - distinct, "duplicated": stored - distinct,
        "unfinished_rollouts": unfinished, "spilled_files": sum(r["spilled"] for r in results),
        # the database's write transactions (the writers' batches) and WAL, per span
        "write_transactions_per_1000_spans": round((counters1["write_transactions"] - counters0["write_transactions"] - 1)
                                                   * 1000 / sent, 2) if counters0 else None,
        "wal_bytes_per_span": round((counters1["wal_bytes"] - counters0["wal_bytes"]) / sent) if counters0 else None,
        "wall_s": round(wall, 3), "spans_per_s": round(sent / wall),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
        # what the machine's cores could carry if this configuration had them to itself: cores / CPU per span
        # of servers + database + clients (shows the design's cost apart from the other work on the machine)
        "spans_per_s_at_full_cores": round(CORES * 1e6 / ours_us),
        "cpu_us_per_span": {"servers": round(sum(servers_s) * us, 1), "database": round(db_s * us, 1),
                            "clients": round(clients_s * us, 1),
                            "other work on the machine": round(max(0.0, busy_s - sum(servers_s) - db_s - clients_s) * us, 1)},
        # share of one core over the wall time: each server (its busiest process), the database, the machine
        "cores_used": {"servers": [round(s / wall, 2) for s in servers_s],
                       "busiest server process": round(max(max(p.values()) for p in per_process) / wall, 2),
                       # each server's processes (uvicorn's supervisor first when it has workers): how evenly
                       # the clients' connections spread over its workers
                       "server processes": [[round(c / wall, 2) for c in p.values()] for p in per_process],
                       "database": round(db_s / wall, 2), "clients": round(clients_s / wall, 2),
                       "machine": round(busy_s / wall, 2), "of": CORES},
    }


def ceiling(run: dict) -> str:
    used = run["cores_used"]
    if used["machine"] >= 0.9 * CORES:
        return f"the machine: {used['machine']:.2f} of {CORES} cores busy"
    if used["busiest server process"] >= 0.9:
        return f"a server process at {used['busiest server process']:.2f} of a core"
    if used["database"] >= 0.9 * CORES:
        return f"the database at {used['database']:.2f} cores"
    return f"no CPU ({used['machine']:.2f} of {CORES} cores busy): waits (commits, round trips)"


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--spans-per-client", type=int, default=5000)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--response-tokens", type=int, default=32)
    ap.add_argument("--batch-ops", type=int, default=500, help="The client's ops per request.")
    ap.add_argument("--workers", type=int, default=2, help="Worker processes of each server (serve's default).")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    cluster = start_cluster("bench-pg-server")
    work = Path(tempfile.mkdtemp(prefix="bench-pg-server-"))
    names = list(CONFIGS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for k in range(args.rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:  # a different one first each round
                run = run_config(name, args, cluster, work)
                run["ceiling"] = ceiling(run)
                runs[name].append(run)
                print(json.dumps({"round": k, **run}), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    sqlite, pg1, pg2, pg2_single = (runs[n] for n in names)
    server_ratio = [p["cpu_us_per_span"]["servers"] / s["cpu_us_per_span"]["servers"] for p, s in zip(pg1, sqlite)]
    two_over_one = [b["spans_per_s"] / a["spans_per_s"] for a, b in zip(pg1, pg2)]
    two_over_one_cpu = [b["spans_per_s_at_full_cores"] / a["spans_per_s_at_full_cores"] for a, b in zip(pg1, pg2)]
    same_processes = [b["spans_per_s"] / a["spans_per_s"] for a, b in zip(pg1, pg2_single)]
    lost = sum(r["lost"] for rs in runs.values() for r in rs)
    doubled = sum(r["duplicated"] for rs in runs.values() for r in rs)
    result = {
        "bench": "pg_store_server", "clients": args.clients, "spans_per_round": args.clients * args.spans_per_client,
        "rounds": args.rounds, "workers_per_server": args.workers, "cores": CORES,
        "configs": {name: {
            "spans_per_s": _summary([r["spans_per_s"] for r in rs]),
            "spans_per_s_at_full_cores": _summary([r["spans_per_s_at_full_cores"] for r in rs]),
            "cpu_us_per_span": {part: _summary([r["cpu_us_per_span"][part] for r in rs])
                                for part in rs[0]["cpu_us_per_span"]},
            "machine_cores_busy": _summary([r["cores_used"]["machine"] for r in rs]),
            "p99_ms": _summary([r["p99_ms"] for r in rs]),
            "lost": sum(r["lost"] for r in rs), "duplicated": sum(r["duplicated"] for r in rs),
            "unfinished_rollouts": sum(r["unfinished_rollouts"] for r in rs),
            "ceilings": [r["ceiling"] for r in rs]} for name, rs in runs.items()},
        "server_cpu_pg_over_sqlite": _summary(server_ratio), "server_cpu_target_max": 1.2,
        "two_servers_over_one": _summary(two_over_one),
        "two_servers_over_one_at_full_cores": _summary(two_over_one_cpu),
        "two_servers_of_1_worker_over_one_of_2": _summary(same_processes),
        "lost": lost, "duplicated": doubled,
        "meets_server_cpu_target": statistics.median(server_ratio) <= 1.2,
        "two_never_slower": min(two_over_one) >= 1.0,
    }
    print(f"\nstore servers, {args.clients} clients, {args.clients * args.spans_per_client:,} LLM spans of "
          f"{args.prompt_tokens}+{args.response_tokens} tokens a round, {args.rounds} rounds, {args.workers} workers "
          f"a server, {CORES} cores; medians (min-max)")
    print(f"{'configuration':32} {'spans/s':>24} | CPU us/span: {'servers':>8} {'database':>9} {'clients':>8} "
          f"{'others':>7} | cores busy | {'at full cores':>13}")
    for name, rs in runs.items():
        c = result["configs"][name]
        rate = c["spans_per_s"]
        cpu = {part: statistics.median(r["cpu_us_per_span"][part] for r in rs) for part in rs[0]["cpu_us_per_span"]}
        print(f"{name:32} {rate['median']:>9,.0f} ({rate['min']:,.0f}-{rate['max']:,.0f}) | {'':12} "
              f"{cpu['servers']:8.1f} {cpu['database']:9.1f} {cpu['clients']:8.1f} "
              f"{cpu['other work on the machine']:7.1f} | {c['machine_cores_busy']['median']:.2f} of {CORES} | "
              f"{c['spans_per_s_at_full_cores']['median']:>13,.0f}")
        for r in rs:
            print(f"    ceiling: {r['ceiling']}; per server {r['cores_used']['servers']} cores (by process "
                  f"{r['cores_used']['server processes']}), database "
                  f"{r['cores_used']['database']}, clients {r['cores_used']['clients']}")
    s = result["server_cpu_pg_over_sqlite"]
    t = result["two_servers_over_one"]
    print(f"server CPU per span, PostgreSQL / SQLite: {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}); "
          f"target <= 1.2x: {'met' if result['meets_server_cpu_target'] else 'NOT met'}")
    print(f"2 servers / 1 server, spans/s: {t['median']:.2f}x ({t['min']:.2f}-{t['max']:.2f}); never slower: "
          f"{'yes' if result['two_never_slower'] else 'NO'}")
    t = result["two_servers_over_one_at_full_cores"]
    print(f"2 servers / 1 server, at full use of the cores (CPU per span): {t['median']:.2f}x ({t['min']:.2f}-"
          f"{t['max']:.2f})")
    t = result["two_servers_of_1_worker_over_one_of_2"]
    print(f"2 servers of 1 worker / 1 server of {args.workers} workers, spans/s: {t['median']:.2f}x ({t['min']:.2f}-"
          f"{t['max']:.2f})")
    print(f"lost {lost}, duplicated {doubled}")
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**result, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
