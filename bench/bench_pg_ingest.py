#!/usr/bin/env python
"""Store ingest into PostgreSQL: ``PostgresStore.add_spans`` against raw batched inserts of the same spans.

Measured: LLM-call ``Span`` records (``bench_store_ingest.py``'s: 64 prompt + 16 response token ids,
log-probs, a message) handed to ``add_spans`` in batches of 1,000, through the row encoding, the
background writer and one transaction a batch, durable on return. Baselines, written by this process
on a connection of its own, one transaction per 1,000: the **already encoded** rows by ``executemany`` of
the ``INSERT`` (psycopg 3's pipeline) and by binary ``COPY``, into the same schema (a store of its own in
the same database: same tables and indexes). Blocks alternate; each writes new spans.

A write here is split between two processes (this one and the database's backend), so the measure is
their CPU together (``time.process_time`` of this process, writer thread included, plus the cluster's
from /proc), per span, and the wall time beside it. The cluster is a throwaway one under ``.cache/``,
fsync on. Target (issue 35): ours >= 0.5 of the raw speed.

    python bench/bench_pg_ingest.py [--spans 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, summary  # noqa: E402
from _postgres import cluster_cpu, start_cluster  # noqa: E402
from bench_store_ingest import make_spans  # noqa: E402

from lightning_rl.store.postgres.sql import INSERT_SPAN  # noqa: E402
from lightning_rl.store.postgres.store import PostgresStore  # noqa: E402
from lightning_rl.store.rows import SPAN_COLUMNS, span_record_values  # noqa: E402

BATCH = 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cluster = start_cluster("bench-pg-ingest")
    url = cluster.create_database()
    ours = PostgresStore(url)
    PostgresStore(url + "?schema=raw").close()  # the same schema, written to directly below
    import psycopg

    raw = psycopg.connect(url, autocommit=True, options="-c search_path=raw")
    types = dict(raw.execute("SELECT attname, atttypid::int FROM pg_attribute WHERE attrelid = 'spans'::regclass "
                             "AND attnum > 0 AND NOT attisdropped").fetchall())
    copy_sql = f"COPY spans ({', '.join(SPAN_COLUMNS)}) FROM STDIN (FORMAT BINARY)"

    def executemany_block(rows: list[tuple]) -> None:
        for start in range(0, len(rows), BATCH):
            with raw.transaction(), raw.cursor() as cur:
                cur.executemany(INSERT_SPAN, rows[start:start + BATCH])

    def copy_block(rows: list[tuple]) -> None:
        for start in range(0, len(rows), BATCH):
            with raw.transaction(), raw.cursor() as cur, cur.copy(copy_sql) as copy:
                copy.set_types([types[c] for c in SPAN_COLUMNS])
                for row in rows[start:start + BATCH]:
                    copy.write_row(row)

    def ours_block(spans: list) -> None:
        for start in range(0, len(spans), BATCH):
            ours.add_spans(spans[start:start + BATCH])

    blocks = {"executemany": executemany_block, "copy": copy_block, "ours": ours_block}
    cpu: dict[str, list[float]] = {name: [] for name in blocks}
    wall: dict[str, list[float]] = {name: [] for name in blocks}
    db_share: dict[str, list[float]] = {name: [] for name in blocks}
    for i in range(args.rounds):
        for name, block in blocks.items():
            # inputs built outside the timed region: ours starts from Span records, the raw inserts from rows
            spans = make_spans(args.spans, f"{name}{i}")
            given = spans if name == "ours" else [span_record_values(span) for span in spans]
            gc.collect()
            w0, c0, d0 = time.perf_counter(), time.process_time(), cluster_cpu(cluster)
            block(given)
            n = len(given)
            w, c, d = time.perf_counter() - w0, time.process_time() - c0, cluster_cpu(cluster) - d0
            cpu[name].append((c + d) * 1e6 / n)
            wall[name].append(w * 1e6 / n)
            db_share[name].append(d * 1e6 / n)
    ours.close()
    stored = {schema: raw.execute(f"SELECT count(*) FROM {schema}.spans").fetchone()[0] for schema in ("lightning_rl", "raw")}
    raw.close()
    expected = args.spans * args.rounds
    speed = {base: [b / o for o, b in zip(cpu["ours"], cpu[base])] for base in ("executemany", "copy")}
    speed_wall = {base: [b / o for o, b in zip(wall["ours"], wall[base])] for base in ("executemany", "copy")}
    result = {
        "bench": "pg_ingest", "spans_per_round": args.spans, "rounds": args.rounds, "batch": BATCH,
        "cpu_us_per_span": {k: summary(v) for k, v in cpu.items()},
        "database_cpu_us_per_span": {k: summary(v) for k, v in db_share.items()},
        "wall_us_per_span": {k: summary(v) for k, v in wall.items()},
        "ours_fraction_of_raw_speed": {k: summary(v) for k, v in speed.items()},
        "ours_fraction_of_raw_speed_wall": {k: summary(v) for k, v in speed_wall.items()},
        "target_min": 0.5, "spans_stored": stored["lightning_rl"], "raw_spans_stored": stored["raw"],
        "spans_expected": expected,
        "meets_target": {k: statistics.median(v) >= 0.5 and stored["lightning_rl"] == expected
                         for k, v in speed.items()},
    }
    report("store ingest into PostgreSQL: add_spans vs raw batched inserts (us per span; CPU = this process + "
           "the database)", [
               ("raw executemany, pre-encoded rows: CPU", summary(cpu["executemany"]), "us"),
               ("raw binary COPY, pre-encoded rows: CPU", summary(cpu["copy"]), "us"),
               ("PostgresStore.add_spans (encode + writer + batch): CPU", summary(cpu["ours"]), "us"),
               ("  of which the database", summary(db_share["ours"]), "us"),
               ("raw executemany: wall", summary(wall["executemany"]), "us"),
               ("raw binary COPY: wall", summary(wall["copy"]), "us"),
               ("PostgresStore.add_spans: wall", summary(wall["ours"]), "us"),
               ("ours speed / executemany speed (CPU)", summary(speed["executemany"]), "x"),
               ("ours speed / COPY speed (CPU)", summary(speed["copy"]), "x"),
               ("ours speed / executemany speed (wall)", summary(speed_wall["executemany"]), "x"),
               ("ours speed / COPY speed (wall)", summary(speed_wall["copy"]), "x"),
           ], result)


if __name__ == "__main__":
    main()
