#!/usr/bin/env python
"""How long a span waits in memory before the SQLite store commits it: the window a process killed
outright (kill -9, an OOM kill) can lose. A traced rollout is durable when its call returns (the store
is flushed); its spans before that are committed by the background writer on its own, which holds a
running rollout's spans for up to its commit window (``store/durable.py`` ``COMMIT_WINDOW``, 50 ms since
issue 46) so that they share a transaction.

Inside one traced call, each tool span is ended and a second SQLite connection polls until the row is
visible; the baseline in the same run is an explicit ``store.flush()`` after a span (a durable write's
round trip). Wall milliseconds per span.

Run: .venv/bin/python bench/bench_commit_window.py [--spans 300]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, summary  # noqa: E402

import lightning_rl as lrl  # noqa: E402
from lightning_rl.store import SQLiteStore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=300)
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="lrl-window-")) / "runs.db"
    store = SQLiteStore(path)
    lrl.configure(store=store)
    reader = sqlite3.connect(path)
    window: list[float] = []
    flushed: list[float] = []

    def committed() -> int:
        return reader.execute("SELECT count(*) FROM spans").fetchone()[0]

    @lrl.trace
    def agent(task):
        for i in range(args.spans):
            seen = committed()
            with lrl.tool_span("step", arguments={"i": i}) as tool:
                tool.result = str(i)
            t0 = time.perf_counter()  # the span has ended: it is queued for the writer
            if i % 2:
                store.flush()
                flushed.append((time.perf_counter() - t0) * 1000)
            else:
                while committed() == seen:
                    pass
                window.append((time.perf_counter() - t0) * 1000)
        return 1.0

    agent({"q": 1})
    stored = committed()
    result = {"bench": "commit_window", "spans": args.spans, "window_ms": summary(window),
              "window_p99_ms": sorted(window)[int(len(window) * 0.99) - 1], "flush_ms": summary(flushed),
              "spans_stored": stored}
    report("a span's time in memory before it is committed (wall ms)", [
        ("the writer on its own: span end -> visible to another reader", summary(window), "ms"),
        ("baseline: span end -> store.flush() returned", summary(flushed), "ms"),
    ], result)
    store.close()


if __name__ == "__main__":
    main()
