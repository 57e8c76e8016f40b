"""Store server throughput: N client processes writing spans through one server.

Ours: `lightning-rl store serve` (a subprocess) and N client processes that write through
``HttpStore`` exactly as the tracer does (``start_rollout``, ``write_span`` with an LLM span's
attributes, ``finish_rollout``, ``flush``). The peer: Agent Lightning's `agl store` server and its
own HTTP client (bench/peer_store_client.py, run in the peer's environment), measured in the same
run with the same span payload (bench/_server_payload.py). Wall time counts from the moment all
clients are connected until the last one has its spans acknowledged; afterwards the stored rows are
counted to report lost and duplicated spans.

    python bench/bench_store_server.py [--clients 8] [--spans-per-client 5000] [--peer-python .venv-peer/bin/python]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _server_payload import llm_attributes  # noqa: E402

SPANS_PER_ROLLOUT = 50


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process and its children (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        total += cpu_seconds(int(child))
    return total


def _client(url: str, index: int, spans: int, prompt: int, response: int, batch_ops: int, barrier, out) -> None:
    """One client process: rollouts of SPANS_PER_ROLLOUT LLM spans each, through HttpStore."""
    from lightning_rl.records import Rollout, RolloutStatus, SpanRow
    from lightning_rl.store.http.client import HttpStore
    from lightning_rl.store.rows import lift_token_attributes

    store = HttpStore(url, spill_dir=tempfile.mkdtemp(prefix=f"bench-spill-{index}-"), batch_ops=batch_ops)
    # The same arrays as the peer's, as our tracer hands them over: packed, beside the attributes.
    payloads = [lift_token_attributes(llm_attributes(prompt, response, seed)) for seed in range(16)]
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for r in range(0, spans, SPANS_PER_ROLLOUT):
        rollout_id = f"c{index}-r{r // SPANS_PER_ROLLOUT}"
        store.start_rollout(Rollout(rollout_id=rollout_id, name="bench"))
        for seq in range(min(SPANS_PER_ROLLOUT, spans - r)):
            now = time.time_ns()
            store.write_span(SpanRow(
                rollout_id=rollout_id, seq=seq, trace_id=index * 10**9 + r + 1, span_id=(r + seq) * 64 + index + 1,
                parent_id=None, name="chat tiny-qwen2", kind="CLIENT", start_ns=now, end_ns=now + 1000,
                status_code="OK", status_message=None, attributes=payloads[seq % 16][0], events=(),
                tokens=payloads[seq % 16][1]))
        store.finish_rollout(rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)
    store.flush()
    out.put({"client": index, "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
             "latencies": store.latencies,
             "spilled": len(store.spill_files)})
    store.close()


def run_ours(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-store-server-"))
    db = work / "served.db"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db", str(db),
                               "--port", str(port), "--workers", str(args.workers),
                               "--synchronous", args.synchronous],
                              stdout=subprocess.DEVNULL)
    try:
        wait_ready(f"{url}/v1/health")
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(args.clients + 1), ctx.Queue()
        procs = [ctx.Process(target=_client, args=(url, i, args.spans_per_client, args.prompt_tokens,
                                                   args.response_tokens, args.batch_ops, barrier, out)) for i in range(args.clients)]
        for p in procs:
            p.start()
        barrier.wait()
        t0, server_cpu = time.perf_counter(), cpu_seconds(server.pid)
        results = [out.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - t0
        server_cpu = cpu_seconds(server.pid) - server_cpu
        for p in procs:
            p.join()
    finally:
        server.terminate()
        server.wait(30)
    conn = sqlite3.connect(db)
    stored, distinct = conn.execute("SELECT COUNT(*), COUNT(DISTINCT rollout_id || ':' || seq) FROM spans").fetchone()
    unfinished = conn.execute("SELECT COUNT(*) FROM rollouts WHERE status != 'succeeded'").fetchone()[0]
    conn.close()
    shutil.rmtree(work, ignore_errors=True)
    sent = args.clients * args.spans_per_client
    latencies = sorted(x for r in results for x in r["latencies"])
    return {"system": "lightning-rl", "clients": args.clients, "spans": sent, "stored": stored,
            "lost": sent - distinct, "duplicated": stored - distinct, "unfinished_rollouts": unfinished,
            "wall_s": round(wall, 3), "spans_per_s": round(sent / wall), "requests": len(latencies),
            "p50_ms": round(1000 * statistics.median(latencies), 2),
            "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
            "spilled_files": sum(r["spilled"] for r in results),
            "client_cpu_s": round(sum(r["cpu_s"] for r in results), 2), "server_cpu_s": round(server_cpu, 2)}


def run_peer(args: argparse.Namespace) -> dict:
    port = free_port()
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    agl = str(Path(args.peer_python).parent / "agl")
    server = subprocess.Popen([agl, "store", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}{args.peer_health}")
        done = subprocess.run([args.peer_python, str(HERE / "peer_store_client.py"), "--url", f"http://127.0.0.1:{port}",
                               "--clients", str(args.clients),
                               "--spans-per-client", str(args.peer_spans_per_client or args.spans_per_client),
                               "--prompt-tokens", str(args.prompt_tokens), "--response-tokens", str(args.response_tokens)],
                              env=env, capture_output=True, text=True, timeout=1800, check=True)
    finally:
        server.terminate()
        server.wait(30)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--spans-per-client", type=int, default=5000)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--response-tokens", type=int, default=32)
    ap.add_argument("--batch-ops", type=int, default=500, help="Our client's ops per request.")
    ap.add_argument("--workers", type=int, default=2, help="Our server's worker processes (the server's default).")
    ap.add_argument("--rounds", type=int, default=3, help="Runs of ours (median reported).")
    ap.add_argument("--synchronous", choices=("full", "normal"), default="full",
                    help="Our server's SQLite synchronous setting (the server's default: full).")
    ap.add_argument("--peer-python", default=None, help="Python of the peer's environment (.venv-peer/bin/python).")
    ap.add_argument("--peer-spans-per-client", type=int, default=None, help="Default: --spans-per-client.")
    ap.add_argument("--peer-health", default="/v1/agl/health")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    rounds = [run_ours(args) for _ in range(args.rounds)]
    for r in rounds:
        print(json.dumps(r), file=sys.stderr)
    ours = sorted(rounds, key=lambda r: r["spans_per_s"])[len(rounds) // 2]
    ours["spans_per_s_all_rounds"] = [r["spans_per_s"] for r in rounds]
    result = {"ours": ours}
    if args.peer_python:
        result["peer"] = run_peer(args)
        result["ratio"] = round(ours["spans_per_s"] / max(1, result["peer"]["spans_per_s"]), 1)
    print(f"\nstore server, {args.clients} clients, LLM spans of {args.prompt_tokens}+{args.response_tokens} tokens")
    for name, r in (("lightning-rl", ours), ("agentlightning", result.get("peer"))):
        if r:
            print(f"  {name:15} {r['spans_per_s']:>9,} spans/s   p99 {r['p99_ms']:8.1f} ms   "
                  f"lost {r['lost']}  duplicated {r['duplicated']}")
    if "ratio" in result:
        print(f"  ratio: {result['ratio']}x")
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
