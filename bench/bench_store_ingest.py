#!/usr/bin/env python
"""Store ingest speed: ``SQLiteStore.add_spans`` against raw batched SQLite inserts of the same spans.

Measured: spans (pydantic ``Span`` records with LLM-call attributes and tokens) handed to ``add_spans`` in
batches of 1000, through JSON encoding, the background writer and batched transactions, durable
on return. Baseline: ``executemany`` of the already-encoded rows into the same table schema
(same indexes, WAL, synchronous=NORMAL), one transaction per 1000. Blocks alternate; CPU time.
Target: ours >= 50% of the raw speed.

Run: .venv/bin/python bench/bench_store_ingest.py [--spans 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_rounds, report, summary  # noqa: E402

from lightning_rl import semconv  # noqa: E402
from lightning_rl.records import Span, SpanTokens  # noqa: E402
from lightning_rl.store import SQLiteStore  # noqa: E402
from lightning_rl.store.rows import span_record_values  # noqa: E402
from lightning_rl.store.sqlite.writes import INSERT_SPAN  # noqa: E402

BATCH = 1000


def make_spans(n: int, rollout: str) -> list[Span]:
    attrs = {
        semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_REQUEST_MODEL: "tiny",
        semconv.TOKEN_IDS_SOURCE: "engine",
        semconv.GEN_AI_INPUT_MESSAGES: orjson.dumps([{"role": "user", "content": "What is 12+30?"}]).decode(),
    }
    return [Span(rollout_id=rollout, seq=i, trace_id="%032x" % 1, span_id="%016x" % (i + 1), name="chat tiny",
                 kind="CLIENT", start_ns=i, end_ns=i + 1, attributes={**attrs, semconv.LLM_CALL_INDEX: i},
                 tokens=SpanTokens(prompt_ids=list(range(64)), response_ids=list(range(16)), response_logprobs=[-0.5] * 16))
            for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lrl-ingest-"))
    ours_store = SQLiteStore(tmp / "ours.db")
    raw_store = SQLiteStore(tmp / "raw.db")  # same schema and PRAGMAs; written to directly below
    raw = raw_store._wconn
    # Inputs are built outside the timed region: both blocks start from ready records / rows.
    prepared = {i: make_spans(args.spans, f"r{i}") for i in range(args.rounds)}
    encoded = {i: [span_record_values(s) for s in make_spans(args.spans, f"b{i}")] for i in range(args.rounds)}

    def baseline_block() -> int:
        rows = encoded.pop(min(encoded))
        for start in range(0, len(rows), BATCH):
            raw.execute("BEGIN IMMEDIATE")
            raw.executemany(INSERT_SPAN, rows[start:start + BATCH])
            raw.execute("COMMIT")
        return len(rows)

    def ours_block() -> int:
        spans = prepared.pop(min(prepared))
        for start in range(0, len(spans), BATCH):
            ours_store.add_spans(spans[start:start + BATCH])
        return len(spans)

    results = cpu_rounds({"baseline": baseline_block, "ours": ours_block}, args.rounds)
    speed = [b / o for o, b in zip(results["ours"], results["baseline"])]  # ours speed / raw speed
    stored = ours_store._read("SELECT count(*) FROM spans")[0][0]
    result = {
        "bench": "store_ingest", "spans_per_round": args.spans, "rounds": args.rounds, "batch": BATCH,
        "raw_us_per_span": summary(results["baseline"]), "ours_us_per_span": summary(results["ours"]),
        "ours_fraction_of_raw_speed": summary(speed), "target_min": 0.5,
        "spans_stored": stored, "spans_expected": args.spans * args.rounds,
        "meets_target": summary(speed)["median"] >= 0.5 and stored == args.spans * args.rounds,
    }
    report("store ingest: add_spans vs raw batched SQLite insert (CPU us per span)", [
        ("raw executemany, pre-encoded rows (baseline)", summary(results["baseline"]), "us"),
        ("SQLiteStore.add_spans (encode + writer + batch)", summary(results["ours"]), "us"),
        ("ours speed as a fraction of raw speed", summary(speed), "x"),
    ], result)
    ours_store.close()
    raw_store.close()


if __name__ == "__main__":
    main()
