#!/usr/bin/env python
"""What ``synchronous=FULL`` costs a traced rollout, against the default ``NORMAL`` (same run).

Each rollout is a traced call with 5 tool spans and a returned reward; it is durable before the call
returns (the store is flushed), so every rollout pays one commit. NORMAL in WAL mode survives the
process being killed; FULL adds an fsync of the WAL per commit and also survives a power loss or an
OS crash. Blocks alternate; wall time per rollout (an fsync is waiting, not CPU).

Run: .venv/bin/python bench/bench_sqlite_synchronous.py [--rollouts 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, summary  # noqa: E402

import lightning_rl as lrl  # noqa: E402
from lightning_rl.store import SQLiteStore  # noqa: E402


@lrl.trace
def agent(task):
    for i in range(5):
        with lrl.tool_span("step", arguments={"i": i}) as tool:
            tool.result = str(i)
    return 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lrl-sync-"))
    stores = {mode: SQLiteStore(tmp / f"{mode}.db", synchronous=mode) for mode in ("normal", "full")}
    ms: dict[str, list[float]] = {mode: [] for mode in stores}
    for _ in range(args.rounds):
        for mode, store in stores.items():
            lrl.configure(store=store)
            t0 = time.perf_counter()
            for i in range(args.rollouts):
                agent({"i": i})
            ms[mode].append((time.perf_counter() - t0) * 1000 / args.rollouts)
    ratio = [f / n for n, f in zip(ms["normal"], ms["full"])]
    stored = {mode: len(store.rollouts()) for mode, store in stores.items()}
    result = {"bench": "sqlite_synchronous", "rollouts_per_round": args.rollouts, "rounds": args.rounds,
              "normal_ms_per_rollout": summary(ms["normal"]), "full_ms_per_rollout": summary(ms["full"]),
              "full_over_normal": summary(ratio), "rollouts_stored": stored}
    report("durable rollouts: synchronous=NORMAL (default) vs FULL (wall ms per rollout)", [
        ("NORMAL: survives a killed process", summary(ms["normal"]), "ms"),
        ("FULL: survives a power loss too (fsync per commit)", summary(ms["full"]), "ms"),
        ("FULL / NORMAL", summary(ratio), "x"),
    ], result)
    for store in stores.values():
        store.close()


if __name__ == "__main__":
    main()
