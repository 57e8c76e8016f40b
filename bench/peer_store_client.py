#!/usr/bin/env python
"""Load client for Microsoft Agent Lightning's store server (``agl store``), the peer's side of the
side-by-side store-server benchmark.

Runs in the peer's own environment (scripts/make_peer_venv.sh builds .venv-peer) against a server
started with ``agl store --host 127.0.0.1 --port P``. ``--clients`` spawned worker processes each
create their own rollouts (``LightningStoreClient.start_rollout``, one per ``--spans-per-rollout``
spans), build their LLM-call spans (attributes from ``_server_payload.llm_attributes``) and then,
all released together by a barrier, send them in calls of ``--batch`` spans through one of the two
write paths the peer offers:

- ``otlp`` (default): OTLP/HTTP protobuf ``POST /v1/traces`` with OpenTelemetry's
  ``OTLPSpanExporter`` aimed at ``LightningStoreClient.otlp_traces_endpoint()``. This is the peer's
  only bulk path over HTTP (its server calls it "the recommended path for ... bulk-insertion") and
  the one its tracer uses against a store server; the server issues the sequence ids.
- ``client``: ``LightningStoreClient.add_many_spans(spans)``, which over HTTP is a loop of one
  ``POST /v1/agl/spans`` per span (no bulk route exists); sequence ids are assigned here.

Rollout creation, span building and imports happen before the barrier and are not timed. Measured:
the latency of every send call and the wall time from the barrier to the last worker's end. Then
every rollout's spans are queried back (``LightningStoreClient.query_spans``) to count lost and
duplicated spans. Prints one JSON line on stdout; progress goes to stderr.

Run: .venv-peer/bin/python bench/peer_store_client.py --url http://127.0.0.1:P [--clients 8]
     [--spans-per-client 5000] [--batch 500] [--path otlp|client]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# litellm (imported by agentlightning) would otherwise fetch its model cost map from the internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agentlightning  # noqa: E402
from _server_payload import llm_attributes  # noqa: E402
from agentlightning.semconv import LightningResourceAttributes  # noqa: E402
from agentlightning.store.client_server import LightningStoreClient  # noqa: E402
from agentlightning.types import OtelResource, Span, SpanContext, TraceStatus  # noqa: E402
from opentelemetry import trace as trace_api  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402

SPAN_NAME = "chat tiny-qwen2"
REQUEST_TIMEOUT_S = 30.0  # the same as LightningStoreClient's default request timeout


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the result line."""
    print(f"[peer_store_client] {message}", file=sys.stderr, flush=True)


def span_id(worker: int, index: int) -> str:
    """A 16-hex-digit span id unique across workers."""
    return f"{worker:04x}{index + 1:012x}"


def trace_id(worker: int, rollout_index: int) -> str:
    """A 32-hex-digit trace id: one trace per rollout."""
    return f"{worker + 1:016x}{rollout_index + 1:016x}"


async def create_rollouts(client: LightningStoreClient, worker: int, count: int) -> list[tuple[str, str]]:
    """Start ``count`` rollouts (each comes with its first attempt); returns (rollout_id, attempt_id)."""
    pairs = []
    for i in range(count):
        attempted = await client.start_rollout(input={"worker": worker, "task": i}, worker_id=f"bench-{worker}")
        pairs.append((attempted.rollout_id, attempted.attempt.attempt_id))
    return pairs


def span_plan(worker: int, n_spans: int, per_rollout: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """What each span carries, independent of the write path: ids, times and attributes."""
    now_ns = time.time_ns()
    return [
        {
            "rollout_index": i // per_rollout,
            "sequence_id": i % per_rollout + 1,
            "span_id": span_id(worker, i),
            "trace_id": trace_id(worker, i // per_rollout),
            "start_ns": now_ns + i * 1000,
            "end_ns": now_ns + i * 1000 + 500,
            "attributes": llm_attributes(args.prompt_tokens, args.response_tokens, seed=worker * 1_000_003 + i),
        }
        for i in range(n_spans)
    ]


def peer_span(plan: dict[str, Any], rollout_id: str, attempt_id: str) -> Span:
    """The peer's own Span model, filled as ``Span.from_opentelemetry`` would fill it."""
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=plan["sequence_id"],
        trace_id=plan["trace_id"],
        span_id=plan["span_id"],
        parent_id=None,
        name=SPAN_NAME,
        status=TraceStatus(status_code="OK"),
        attributes=plan["attributes"],
        events=[],
        links=[],
        start_time=plan["start_ns"] / 1e9,
        end_time=plan["end_ns"] / 1e9,
        context=SpanContext(trace_id=plan["trace_id"], span_id=plan["span_id"], is_remote=False, trace_state={}),
        parent=None,
        resource=OtelResource(attributes={}, schema_url=""),
    )


def otel_span(plan: dict[str, Any], resource: Resource) -> ReadableSpan:
    """An OpenTelemetry ReadableSpan, as the peer's tracer hands it to its OTLP exporter; the resource
    carries the rollout and attempt ids the way ``LightningStoreOTLPExporter`` sets them."""
    context = trace_api.SpanContext(
        trace_id=int(plan["trace_id"], 16),
        span_id=int(plan["span_id"], 16),
        is_remote=False,
        trace_flags=trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED),
    )
    return ReadableSpan(
        name=SPAN_NAME,
        context=context,
        resource=resource,
        attributes=plan["attributes"],
        kind=trace_api.SpanKind.CLIENT,
        status=trace_api.Status(trace_api.StatusCode.OK),
        start_time=plan["start_ns"],
        end_time=plan["end_ns"],
    )


def build_items(plans: list[dict[str, Any]], pairs: list[tuple[str, str]], path: str) -> list[Any]:
    """The objects the chosen write path sends, built before timing starts."""
    if path == "client":
        return [peer_span(p, *pairs[p["rollout_index"]]) for p in plans]
    resources = [
        Resource.create(
            {LightningResourceAttributes.ROLLOUT_ID.value: r, LightningResourceAttributes.ATTEMPT_ID.value: a}
        )
        for r, a in pairs
    ]
    return [otel_span(p, resources[p["rollout_index"]]) for p in plans]


def make_sender(client: LightningStoreClient, path: str) -> Any:
    """An async function sending one batch; returns how many spans the peer reports as accepted
    (``otlp``: the whole batch on SpanExportResult.SUCCESS, else 0)."""
    if path == "client":

        async def send_client(batch: list[Span]) -> int:
            return len(await client.add_many_spans(batch))

        return send_client

    exporter = OTLPSpanExporter(endpoint=client.otlp_traces_endpoint(), timeout=REQUEST_TIMEOUT_S)

    async def send_otlp(batch: list[ReadableSpan]) -> int:
        # OTLPSpanExporter.export is blocking (requests); the worker has nothing else to run meanwhile.
        return len(batch) if exporter.export(batch) is SpanExportResult.SUCCESS else 0

    return send_otlp


async def worker_run(worker: int, args: argparse.Namespace, barrier: Any) -> dict[str, Any]:
    """One client: set up (untimed), wait at the barrier, send all batches, report timings."""
    client = LightningStoreClient(args.url, request_timeout=REQUEST_TIMEOUT_S)
    n_rollouts = -(-args.spans_per_client // args.spans_per_rollout)
    pairs = await create_rollouts(client, worker, n_rollouts)
    plans = span_plan(worker, args.spans_per_client, args.spans_per_rollout, args)
    items = build_items(plans, pairs, args.path)
    send = make_sender(client, args.path)
    await send(items[:0])  # otlp: opens the exporter's connection untimed (client: start_rollout did)
    barrier.wait()
    start = time.perf_counter()
    latencies_ms, accepted = [], 0
    for lo in range(0, len(items), args.batch):
        t0 = time.perf_counter()
        accepted += await send(items[lo : lo + args.batch])
        latencies_ms.append((time.perf_counter() - t0) * 1000)
    end = time.perf_counter()
    await client.close()
    expected = {r: [] for r, _ in pairs}
    for p in plans:
        expected[pairs[p["rollout_index"]][0]].append(p["span_id"])
    return {"start": start, "end": end, "latencies_ms": latencies_ms, "accepted": accepted, "expected": expected}


def worker_main(worker: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    """Process entry point (spawned): runs the worker and puts its result on the queue."""
    results.put(asyncio.run(worker_run(worker, args, barrier)))


async def count_stored(url: str, expected: dict[str, list[str]]) -> tuple[int, int, int]:
    """Query every rollout back; returns (distinct expected spans found, lost, duplicated copies)."""
    client = LightningStoreClient(url, request_timeout=120.0)
    found = lost = duplicated = 0
    for rollout_id, sent_ids in expected.items():
        stored = await client.query_spans(rollout_id)
        copies = Counter(span.span_id for span in stored.items)
        found += sum(1 for s in sent_ids if copies[s] > 0)
        lost += sum(1 for s in sent_ids if copies[s] == 0)
        duplicated += sum(n - 1 for n in copies.values())
    await client.close()
    return found, lost, duplicated


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of ``values``, with linear interpolation."""
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1] if len(values) > 1 else values[0]


def run_workers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn the workers, release them together, and collect their results."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.clients, timeout=600)
    results = ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(w, args, barrier, results)) for w in range(args.clients)]
    for p in procs:
        p.start()
    log(f"{args.clients} workers started; setting up and sending")
    out = [results.get(timeout=3600) for _ in procs]  # drain before join (large queue items)
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise SystemExit(f"workers failed with exit codes {failed}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the agl store server, e.g. http://127.0.0.1:4747")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--spans-per-client", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500, help="spans per send call")
    parser.add_argument("--spans-per-rollout", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument("--path", choices=["otlp", "client"], default="otlp", help="write path (see above)")
    args = parser.parse_args()

    results = run_workers(args)
    wall_s = max(r["end"] for r in results) - min(r["start"] for r in results)
    latencies = [ms for r in results for ms in r["latencies_ms"]]
    expected = {rid: ids for r in results for rid, ids in r["expected"].items()}
    sent = sum(len(ids) for ids in expected.values())
    log(f"sent {sent} spans in {wall_s:.2f} s; querying {len(expected)} rollouts back")
    stored, lost, duplicated = asyncio.run(count_stored(args.url, expected))
    print(json.dumps({
        "system": "agentlightning", "version": agentlightning.__version__, "path": args.path,
        "clients": args.clients, "spans": sent, "accepted": sum(r["accepted"] for r in results),
        "stored": stored, "lost": lost, "duplicated": duplicated,
        "wall_s": round(wall_s, 3), "spans_per_s": round(sent / wall_s, 1),
        "p50_ms": round(percentile(latencies, 50), 2), "p99_ms": round(percentile(latencies, 99), 2),
        "batch": args.batch, "spans_per_rollout": args.spans_per_rollout,
        "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
    }))


if __name__ == "__main__":
    main()
