"""Helpers shared by the bench scripts: alternating CPU-time rounds, a table and a JSON line."""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable


def cpu_rounds(blocks: dict[str, Callable[[], int]], rounds: int, collect: bool = False) -> dict[str, list[float]]:
    """Run each block ``rounds`` times, alternating blocks within every round. Each block returns
    how many items it processed; the result is CPU microseconds per item (process_time counts all
    threads of the process, so background writers are included). ``collect``: a full garbage
    collection before each block (not timed), so that no block pays for the garbage of another."""
    out: dict[str, list[float]] = {name: [] for name in blocks}
    for _ in range(rounds):
        for name, block in blocks.items():
            if collect:
                gc.collect()
            t0 = time.process_time()
            n = block()
            out[name].append((time.process_time() - t0) * 1e6 / n)
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report(title: str, rows: list[tuple[str, dict[str, float], str]], result: dict) -> None:
    print(f"\n{title}")
    print(f"{'what':58} {'median':>9} {'min':>9} {'max':>9}  unit")
    for name, s, unit in rows:
        print(f"{name:58} {s['median']:9.2f} {s['min']:9.2f} {s['max']:9.2f}  {unit}")
    print(json.dumps(result))


def adapter_call(client: object, options: object) -> object:
    """The OpenAI adapter's own captured call for one request inside the current rollout: what its
    wrapper of ``client.request`` makes before the client sends it (record it with ``record_response``)."""
    from lightning_rl.adapters.openai import _start

    return _start(client, options)[0]
