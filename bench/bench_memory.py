#!/usr/bin/env python
"""Memory while tracing 100,000 LLM-call spans: it must stay flat (the writer's queue is bounded).

Traces LLM-call spans through the OpenAI adapter's code path into a SQLite store, in rollouts of
1,000 spans, and samples the process RSS after every 10,000. Baseline: the RSS growth of the same
loop with bare OpenTelemetry SDK spans (no processor) measured in the same run. "Flat" means the
growth from 20,000 to 100,000 spans stays under 16 MiB (the queue holds at most 8,192 records).

Run: .venv/bin/python bench/bench_memory.py [--spans 100000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import openai
from openai._models import FinalRequestOptions
from opentelemetry.sdk.trace import TracerProvider

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_span_cost import fake_vllm_response  # noqa: E402

import lightning_rl as lrl  # noqa: E402
from _common import adapter_call  # noqa: E402

PER_ROLLOUT = 1000
STEP = 10000


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=100000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lrl-mem-"))
    store = lrl.configure(store=f"sqlite:///{tmp / 'mem.db'}")
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")
    body = {"model": "tiny", "max_tokens": 128, "messages": [{"role": "user", "content": "What is 12+30?"}]}
    options = FinalRequestOptions(method="post", url="/chat/completions", json_data=body)
    response = fake_vllm_response(256, 64)

    @lrl.trace
    def rollout(i: int) -> float:
        for _ in range(PER_ROLLOUT):
            adapter_call(client, options).record_response(response)
        return 1.0

    bare = TracerProvider().get_tracer("bench")
    attributes = None

    def series(run_block) -> list[float]:
        out = []
        for done in range(0, args.spans, STEP):
            run_block(done)
            out.append(round(rss_mib(), 1))
        return out

    def ours_block(done: int) -> None:
        for r in range(STEP // PER_ROLLOUT):
            rollout(done + r)

    rollout(-1)  # warm up, and take the final attributes for the baseline
    attributes = store.spans(store.rollouts()[-1].rollout_id)[1].attributes

    def bare_block(done: int) -> None:
        for _ in range(STEP):
            bare.start_span("chat tiny", attributes=attributes).end()

    baseline = series(bare_block)
    ours = series(ours_block)
    stored = store._read("SELECT count(*) FROM spans WHERE name != 'invoke_agent rollout'")[0][0]
    growth = ours[-1] - ours[1]
    result = {
        "bench": "memory", "spans": args.spans, "rss_mib_every_10k_ours": ours,
        "rss_mib_every_10k_bare_otel": baseline, "growth_20k_to_end_mib": round(growth, 1),
        "bare_otel_growth_20k_to_end_mib": round(baseline[-1] - baseline[1], 1), "target_growth_max_mib": 16,
        "llm_spans_stored": stored, "llm_spans_expected": args.spans + PER_ROLLOUT,
        "meets_target": growth < 16 and stored == args.spans + PER_ROLLOUT,
    }
    print("\nRSS (MiB) after every 10,000 spans")
    print("bare OTel spans (baseline):", baseline)
    print("lightning-rl to SQLite:    ", ours)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
