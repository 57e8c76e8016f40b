#!/usr/bin/env python
"""What the gateway adds per LLM call, against a fast fake upstream (issue 17's benchmark).

Three processes: a fake OpenAI-compatible engine (a bare ASGI app under uvicorn that answers every
chat completion at once with a fixed 16-token answer, token ids and log-probs included, streamed as
16 chunks or not), ``lightning-rl gateway`` in front of it writing to a fresh SQLite store, and this
client. The baseline is measured in the same run: the same requests sent straight to the engine.

* Latency: one call at a time (``--calls`` of them after a warm-up), p50 and p99 of the wall time
  of a whole call (the stream read to its end), direct and through the gateway; the gateway's cost
  is the difference.
* Throughput: ``--concurrency`` calls in flight for ``--seconds``, calls per second, direct and
  through the gateway (one gateway worker, one process), loaded by the gateway's own lean client
  (``lightning_rl.gateway.upstream``) so that the client leaves the gateway a core.

Goal (issue 17): adds <= 1 ms at p50 and sustains >= 2,000 calls/s per worker. On this 2-core
machine the client, the gateway and the engine share the cores, so the throughput through the
gateway is bounded by that too; the direct figure in the same run shows how much. The gateway's
own CPU time per call (from /proc, during the throughput run) gives what one worker sustains with a
core to itself: ``calls_per_gateway_cpu_s``.

Run: .venv/bin/python bench/bench_gateway.py [--calls 300] [--concurrency 32] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_ENGINE = r'''
import json, sys, uvicorn
TOKENS = %d
IDS = list(range(100, 100 + TOKENS))

def full():
    return json.dumps({"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake",
        "prompt_token_ids": list(range(1, 40)),
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": IDS,
                     "message": {"role": "assistant", "content": "x" * TOKENS},
                     "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                              for _ in IDS]}}],
        "usage": {"prompt_tokens": 39, "completion_tokens": TOKENS, "total_tokens": 39 + TOKENS}}).encode()

def chunks():
    out = []
    for i, t in enumerate(IDS):
        choice = {"index": 0, "delta": {"content": "x"} if i else {"role": "assistant", "content": "x"},
                  "token_ids": [t], "finish_reason": "stop" if i == TOKENS - 1 else None,
                  "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": None, "top_logprobs": []}]}}
        chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                 "choices": [choice]}
        if i == 0:
            chunk["prompt_token_ids"] = list(range(1, 40))
        out.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return out + [b"data: [DONE]\n\n"]

FULL, CHUNKS = full(), chunks()

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    stream = b'"stream": true' in body or b'"stream":true' in body
    headers = [(b"content-type", b"text/event-stream" if stream else b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if stream:
        for c in CHUNKS:
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.body", "body": FULL})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
''' % TOKENS


def _wait(url: str, deadline: float = 60.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(client: httpx.AsyncClient, url: str, stream: bool) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": TOKENS}
    if stream:
        async with client.stream("POST", url, json=body) as r:
            async for _ in r.aiter_raw():
                pass
            assert r.status_code == 200, r.status_code
    else:
        r = await client.post(url, json=body)
        assert r.status_code == 200, r.text


async def _latency(url: str, stream: bool, calls: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(20):
            await _one(client, url, stream)
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            await _one(client, url, stream)
            times.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": round(statistics.median(times), 3), "p99_ms": round(_percentile(times, 0.99), 3)}


async def _throughput(url: str, stream: bool, concurrency: int, seconds: float) -> float:
    """Calls per second with ``concurrency`` in flight. The load comes from the gateway's own lean
    HTTP client (``lightning_rl.gateway.upstream``, about 0.04 ms of CPU a call) rather than httpx
    (about 1 ms), so that on this 2-core machine the client leaves the gateway a core."""
    from lightning_rl.gateway.upstream import Upstream

    parts = urllib.parse.urlsplit(url)
    pool, path = Upstream(f"{parts.scheme}://{parts.netloc}", timeout=30), parts.path
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                       "max_tokens": TOKENS}).encode()
    done = 0
    end = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < end:
            response = await pool.post(path, body, stream=stream)
            assert response.status_code == 200, response.status_code
            await response.read()
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    pool.close()
    return round(done / elapsed, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="sequential calls per latency measurement")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each throughput measurement")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    engine_port, gateway_port = _free_port(), _free_port()
    engine = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, str(engine_port)])
    gateway = subprocess.Popen([str(ROOT / ".venv" / "bin" / "lightning-rl"), "gateway", "--upstream",
                                f"http://127.0.0.1:{engine_port}", "--store", str(work / "runs.db"),
                                "--port", str(gateway_port)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    results: dict[str, dict] = {}
    try:
        direct = f"http://127.0.0.1:{engine_port}/v1/chat/completions"
        _wait(f"http://127.0.0.1:{engine_port}/")
        _wait(f"http://127.0.0.1:{gateway_port}/v1/health")
        opened = httpx.post(f"http://127.0.0.1:{gateway_port}/v1/rollouts", json={"task": "bench"}).json()
        through = opened["base_url"] + "/chat/completions"
        for stream in (False, True):
            kind = "stream" if stream else "plain"
            row = {"direct": asyncio.run(_latency(direct, stream, args.calls)),
                   "gateway": asyncio.run(_latency(through, stream, args.calls))}
            row["added_p50_ms"] = round(row["gateway"]["p50_ms"] - row["direct"]["p50_ms"], 3)
            row["added_p99_ms"] = round(row["gateway"]["p99_ms"] - row["direct"]["p99_ms"], 3)
            row["calls_per_s_direct"] = asyncio.run(_throughput(direct, stream, args.concurrency, args.seconds))
            cpu = _cpu_seconds(gateway.pid)
            row["calls_per_s_gateway"] = asyncio.run(_throughput(through, stream, args.concurrency, args.seconds))
            calls = row["calls_per_s_gateway"] * args.seconds
            row["gateway_cpu_ms_per_call"] = round((_cpu_seconds(gateway.pid) - cpu) * 1000 / calls, 3)
            # what one worker would sustain with a core to itself: the client here takes most of a core
            row["calls_per_gateway_cpu_s"] = round(1000 / row["gateway_cpu_ms_per_call"], 1)
            results[kind] = row
            print(f"{kind:6}: direct p50 {row['direct']['p50_ms']:.2f} ms, through the gateway p50 "
                  f"{row['gateway']['p50_ms']:.2f} ms (adds {row['added_p50_ms']:.2f} ms p50, {row['added_p99_ms']:.2f} "
                  f"ms p99); {row['calls_per_s_direct']:.0f} calls/s direct, {row['calls_per_s_gateway']:.0f} through "
                  f"the gateway ({args.concurrency} in flight), the gateway's CPU {row['gateway_cpu_ms_per_call']:.3f} ms "
                  f"a call = {row['calls_per_gateway_cpu_s']:.0f} calls per CPU second", flush=True)
        httpx.post(f"http://127.0.0.1:{gateway_port}/v1/rollouts/{opened['rollout_id']}/finish", json={})
    finally:
        for proc in (gateway, engine):
            proc.terminate()
            proc.wait(30)
    import sqlite3

    recorded = sqlite3.connect(work / "runs.db").execute(
        "SELECT count(*) FROM spans WHERE name LIKE 'chat %'").fetchone()[0]
    summary = {"added_p50_ms": {k: v["added_p50_ms"] for k, v in results.items()},
               "added_p99_ms": {k: v["added_p99_ms"] for k, v in results.items()},
               "calls_per_s_gateway": {k: v["calls_per_s_gateway"] for k, v in results.items()},
               "calls_per_s_direct": {k: v["calls_per_s_direct"] for k, v in results.items()},
               "calls_per_gateway_cpu_s": {k: v["calls_per_gateway_cpu_s"] for k, v in results.items()},
               "calls_recorded": recorded, "cores": os.cpu_count(), "detail": results}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
