#!/usr/bin/env python
"""How fast the viewer's pages answer on a large store (issue 18's goals: the list of a 100k-rollout
store in < 300 ms, a rollout's page in < 200 ms; issue 35's, over PostgreSQL: no page slower than 200 ms,
at p50 or at worst).

A fresh SQLite store (``--store postgres``: a database of a throwaway PostgreSQL cluster under ``.cache/``)
gets ``--rollouts`` rollouts (default 100,000): 8 agents, 3 modes, 4 statuses, 20
policy versions, a task with a question, a reward each, groups of 8, and for every rollout an LLM call
of 60 prompt + 40 response tokens. ``lightning-rl view`` serves it from its own process; this process
asks for each page ``--repeat`` times (httpx, one at a time) and reports p50, p99 and the worst of the
whole request. Baselines measured in the same run: the viewer's ``/health`` (the HTTP floor of a page), and
the same first page read straight from the store by the older API (``store.rollouts(limit=50,
newest_first=True)``, what ``lightning-rl rollouts ls`` does), in this process.

Run: .venv/bin/python bench/bench_viewer.py [--rollouts 100000] [--repeat 20] [--store postgres] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_rl import semconv  # noqa: E402
from lightning_rl.records import Reward, RewardSource, Rollout, RolloutStatus, Span, SpanTokens  # noqa: E402
from lightning_rl.store.sqlite.store import SQLiteStore  # noqa: E402

LIST_QUERIES = {
    "newest": {},
    "mode+status": {"mode": "train", "status": "failed"},
    "agent+version": {"agent": "agent-3", "policy_version": "7"},
    "sort by reward": {"sort": "reward", "order": "desc"},
    "reward range": {"reward_min": "0.4", "reward_max": "0.6"},
    "text in task": {"text": "question 4242"},
    "page 1000": {"page": "1000"},
}


def fill(store, n: int, seed: int = 0, chunk: int = 500) -> list[str]:
    """``n`` rollouts into ``store``, their spans ``chunk`` rollouts at a time (one ``add_spans``)."""
    rng = random.Random(seed)
    now = time.time() - n
    statuses = [RolloutStatus.SUCCEEDED] * 6 + [RolloutStatus.FAILED, RolloutStatus.TIMED_OUT]
    ids = []
    for first in range(0, n, chunk):
        spans, ends = [], []
        for i in range(first, min(n, first + chunk)):
            rid = f"{i:08d}{rng.getrandbits(64):016x}"
            ids.append(rid)
            store.start_rollout(Rollout(rollout_id=rid, name="bench", agent=f"agent-{i % 8}",
                                        task={"question": f"question {i}", "a": i % 97, "b": i % 89},
                                        group_id=f"g{i // 8}", attempt=i % 8, mode=("train", "eval", "prod")[i % 3],
                                        policy_version=i % 20, start_time=now + i))
            prompt, response = [rng.randrange(5000) for _ in range(60)], [rng.randrange(5000) for _ in range(40)]
            spans.append(Span(rollout_id=rid, seq=0, trace_id="%032x" % (i + 1), span_id="%016x" % (i + 1),
                              name="chat policy", kind="CLIENT", start_ns=int((now + i) * 1e9),
                              end_ns=int((now + i + 0.5) * 1e9), attributes={
                                  semconv.GEN_AI_OPERATION_NAME: "chat", semconv.LLM_CALL_INDEX: 0,
                                  semconv.ROLLOUT_ID: rid, semconv.TOKEN_IDS_SOURCE: "engine",
                                  semconv.GEN_AI_INPUT_MESSAGES: json.dumps([{"role": "user", "content": f"question {i}"}]),
                                  semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps([{"role": "assistant", "content": "42"}])},
                              tokens=SpanTokens(prompt_ids=prompt, response_ids=response,
                                                response_logprobs=[-0.5] * len(response))))
            ends.append((rid, Reward(rollout_id=rid, value=rng.random(), source=RewardSource.RETURNED, time=now + i + 1),
                         statuses[i % len(statuses)], now + i + 1))
        store.add_spans(spans)
        for rid, reward, status, end in ends:
            store.write_reward(reward)
            store.finish_rollout(rid, status, end, None)
    store.flush()
    return ids


def timed(client: httpx.Client, url: str, params: dict | None, repeat: int) -> dict[str, float]:
    client.get(url, params=params)  # warm (the first read of the file's pages)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(url, params=params)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (url, response.status_code, response.text[:300])
    return _stats(times)


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50_ms": round(statistics.median(times), 1),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1), "max_ms": round(max(times), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite",
                        help="postgres: a throwaway PostgreSQL cluster under .cache/ (make postgres installs it)")
    parser.add_argument("--no-vacuum", action="store_true",
                        help="postgres: read right after the fill, before any VACUUM ANALYZE")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-viewer-"))
    if args.store == "postgres":
        sys.path.insert(0, str(ROOT / "bench"))
        from _postgres import start_cluster

        from lightning_rl.store.postgres.store import PostgresStore

        location = start_cluster("bench-pg-viewer").create_database()
        store = PostgresStore(location)
    else:
        location = str(work / "runs.db")
        store = SQLiteStore(location)
    started = time.perf_counter()
    ids = fill(store, args.rollouts)
    fill_s = time.perf_counter() - started
    if args.store == "postgres" and not args.no_vacuum:
        # What autovacuum does within minutes of such a fill (a store that grew over hours has had it): the
        # planner's statistics, and pages marked all-visible, so no read is the first to touch a new row.
        import psycopg

        with psycopg.connect(location, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) lightning_rl.rollouts, lightning_rl.spans, lightning_rl.rewards")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    viewer = subprocess.Popen([str(ROOT / ".venv" / "bin" / "lightning-rl"), "view", "--store", location,
                               "--port", str(port)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    results: dict[str, dict] = {}
    try:
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.get(url + "/health")
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "the viewer did not start"
                    time.sleep(0.2)
            results["baseline: /health"] = timed(client, url + "/health", None, args.repeat)
            base = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                store.rollouts(limit=50, newest_first=True)
                base.append((time.perf_counter() - t0) * 1000)
            results["baseline: store.rollouts(limit=50) in process"] = _stats(base)
            for name, params in LIST_QUERIES.items():
                results[f"list: {name}"] = timed(client, url + "/", params, args.repeat)
            rng = random.Random(1)
            pages = []
            for rid in rng.sample(ids, args.repeat):
                t0 = time.perf_counter()
                assert client.get(f"{url}/rollouts/{rid}").status_code == 200
                pages.append((time.perf_counter() - t0) * 1000)
            results["rollout page"] = _stats(pages)
            results["group page (8 tries)"] = timed(client, f"{url}/groups/g{args.rollouts // 16}", None, args.repeat)
    finally:
        viewer.terminate()
        viewer.wait(30)
        store.close()
    worst_list = max(v["p50_ms"] for k, v in results.items() if k.startswith("list:"))
    pages_only = {k: v for k, v in results.items() if not k.startswith("baseline")}
    slowest = max(pages_only, key=lambda k: pages_only[k]["max_ms"])
    summary = {"store": args.store, "vacuumed": args.store == "postgres" and not args.no_vacuum,
               "rollouts": args.rollouts, "fill_s": round(fill_s, 1),
               "worst_list_p50_ms": worst_list, "rollout_page_p50_ms": results["rollout page"]["p50_ms"],
               "goals_met": worst_list < 300 and results["rollout page"]["p50_ms"] < 200,
               "slowest_page": slowest, "slowest_page_max_ms": pages_only[slowest]["max_ms"],
               "no_page_over_200ms": all(v["max_ms"] < 200 for v in pages_only.values()), "detail": results}
    print(f"viewer over {args.store}, {args.rollouts:,} rollouts")
    for name, row in results.items():
        print(f"{name:48} p50 {row['p50_ms']:7.1f} ms   p99 {row['p99_ms']:7.1f} ms   max {row['max_ms']:7.1f} ms",
              flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "detail"}))


if __name__ == "__main__":
    main()
