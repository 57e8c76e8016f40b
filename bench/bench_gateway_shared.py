#!/usr/bin/env python
"""What ``lightning-rl gateway --shared`` (rollouts kept in the store, docs/fleet.md "Two gateways")
costs per LLM call, against the same gateway without it, in the same run.

Processes: a fake OpenAI-compatible engine (the gateway tests' ``fake_engine``, on a thread of this
process), one or two ``lightning-rl gateway`` processes, a ``lightning-rl store serve`` process (for
the store-server rows), and this client. One rollout, ``--calls`` non-streamed calls one at a time
(after 20 of warm-up); with two gateways the calls alternate between them, as a round-robin balancer
sends them. p50 and p99 of a whole call's wall time; ``ratio``: p50 against the same store without
``--shared``. Over SQLite (a file) and over one store server (SQLite behind it).

Run: .venv/bin/python bench/bench_gateway_shared.py [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_rl.serving import ServerThread  # noqa: E402
from lightning_rl.vllm_server import free_port  # noqa: E402
from tests.gateway.test_upstreams import fake_engine  # noqa: E402
from tests.services import wait_healthy  # noqa: E402

TOKEN = "bench-token"


def _start(args: list[str], path: str = "/v1/health") -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", *args, "--port", str(port)],
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, path=path)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


def _calls(urls: list[str], n: int) -> dict[str, float]:
    with httpx.Client(timeout=30) as client:
        opened = client.post(f"{urls[0]}/v1/rollouts", headers={"Authorization": f"Bearer {TOKEN}"},
                             json={"task": 1}).json()
        auth = {"Authorization": f"Bearer {opened['api_key']}"}
        took = []
        for i in range(n + 20):
            start = time.perf_counter()
            answer = client.post(f"{urls[i % len(urls)]}/v1/chat/completions", headers=auth,
                                 json={"model": "m", "messages": [{"role": "user", "content": str(i)}]})
            assert answer.status_code == 200, answer.text
            if i >= 20:
                took.append((time.perf_counter() - start) * 1000)
    took.sort()
    return {"p50_ms": round(took[len(took) // 2], 2), "p99_ms": round(took[int(len(took) * 0.99)], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    opts = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lrl-bench-shared-"))
    engine = ServerThread(fake_engine("e", []), name="fake engine")
    engine.start("a fake engine")
    server, server_url = _start(["store", "serve", "--db", str(tmp / "server.db"), "--workers", "1"])
    rows = []
    try:
        for store_name, store in (("sqlite", None), ("store server", server_url)):
            base = None
            for shared, gateways in ((False, 1), (True, 1), (True, 2)):
                db = store or f"sqlite:///{tmp / f'{store_name}-{shared}-{gateways}.db'}"
                procs = [_start(["gateway", "--token", TOKEN, "--upstream", engine.url, "--store", db]
                                + (["--shared"] if shared else [])) for _ in range(gateways)]
                try:
                    figures = _calls([url for _, url in procs], opts.calls)
                finally:
                    for proc, _ in procs:
                        _stop(proc)
                base = base or figures["p50_ms"]
                rows.append({"store": store_name, "shared": shared, "gateways": gateways, **figures,
                             "ratio": round(figures["p50_ms"] / base, 2)})
    finally:
        _stop(server)
        engine.stop()
    print(f"{'store':<13} {'shared':<7} {'gateways':>8} {'p50 ms':>8} {'p99 ms':>8} {'p50 ratio':>10}")
    for r in rows:
        print(f"{r['store']:<13} {str(r['shared']):<7} {r['gateways']:>8} {r['p50_ms']:>8} {r['p99_ms']:>8} "
              f"{r['ratio']:>10}")
    print(json.dumps({"bench": "gateway_shared", "calls": opts.calls, "rows": rows}))


if __name__ == "__main__":
    main()
