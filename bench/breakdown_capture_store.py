#!/usr/bin/env python
"""What the durable row costs a traced call, and on which thread: the same calls with the SQLite store and with a
sink that drops every span (no store, no writer thread).

One process, openai's own client (or ``--client httpx``) against the in-process transport of
``bench_capture_peers.py``, inside one rollout: blocks of N untraced and N captured calls alternating (the order
swapping every round), the store flushed inside the captured block, as that bench's lightning-rl contender does.
Per round, what a captured call adds: the CPU of the whole process, and of the agent's thread alone (the rest is
the writer's). Median over rounds. Run it once with ``--sink sqlite`` and once with ``--sink none``: the difference
is the durable row's cost, split between the writer's thread and the agent's (docs/benchmarks.md section 7).

Run: .venv/bin/python bench/breakdown_capture_store.py [--shape 40+4] [--sink sqlite|none] [--rounds 21]
     [--client default|httpx]
"""

from __future__ import annotations

import argparse
import contextvars
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_capture_peers as peers  # noqa: E402

import lightning_rl as lrl  # noqa: E402


class DroppingSink:
    """A sink that keeps nothing: the capture's work on the agent's thread, without a store."""

    def start_rollout(self, rollout: object) -> None:
        pass

    def write_span(self, row: object) -> None:
        pass

    def write_reward(self, reward: object) -> None:
        pass

    def finish_rollout(self, *args: object, **kwargs: object) -> None:
        pass

    def flush(self, timeout: float | None = None) -> bool:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="40+4")
    parser.add_argument("--sink", choices=("sqlite", "none"), default="sqlite")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--client", choices=peers.CLIENTS, default="default")
    args = parser.parse_args()
    prompt, response = (int(x) for x in args.shape.split("+"))
    tmp = Path(tempfile.mkdtemp(prefix="breakdown-capture-"))
    peers.write_bodies(prompt, response, tmp / "bodies.pkl")
    bodies = peers.load_bodies(str(tmp / "bodies.pkl"))
    if args.sink == "sqlite":
        store = lrl.configure(store=f"sqlite:///{tmp / 'runs.db'}")
    else:
        from lightning_rl.tracer.provider import tracing

        store = DroppingSink()
        tracing.set_sink(store)
    client, transport = peers.openai_client(args.client, bodies)
    calls = peers.calls_for(prompt, response)

    def block() -> None:
        for _ in range(calls):
            client.chat.completions.create(model="tiny", messages=peers.MESSAGES, max_tokens=response, temperature=1.0)

    adds: list[float] = []
    agent_adds: list[float] = []

    @lrl.trace
    def agent() -> None:
        block()  # warm-up, both ways
        store.flush()
        contextvars.Context().run(block)
        for r in range(args.rounds):
            figures = {}
            for kind in ("untraced", "captured") if r % 2 == 0 else ("captured", "untraced"):
                cpu, own = time.process_time(), time.thread_time()
                if kind == "captured":
                    block()
                    store.flush()
                else:
                    contextvars.Context().run(block)  # an empty context: no rollout, nothing recorded
                figures[kind] = ((time.process_time() - cpu) * 1e6 / calls, (time.thread_time() - own) * 1e6 / calls)
            adds.append(figures["captured"][0] - figures["untraced"][0])
            agent_adds.append(figures["captured"][1] - figures["untraced"][1])

    agent()
    result = {"bench": "breakdown_capture_store", "shape": args.shape, "sink": args.sink, "client": args.client,
              "transport": transport, "calls_per_block": calls, "rounds": args.rounds,
              "adds_us": statistics.median(adds), "agent_thread_adds_us": statistics.median(agent_adds),
              "adds_min_us": min(adds), "adds_max_us": max(adds)}
    print(f"{args.shape} {args.client}, sink {args.sink}: a traced call adds {result['adds_us']:.1f} us "
          f"({result['agent_thread_adds_us']:.1f} on the agent's thread), median of {args.rounds} rounds "
          f"({min(adds):.0f}..{max(adds):.0f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
