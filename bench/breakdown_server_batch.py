#!/usr/bin/env python
"""Where the store server's CPU goes per span: one batch handler's steps, timed apart, in process.

500-op batches as HttpStore sends them (128+32-token LLM spans, tokens packed), through the same
functions the server's ``/batch`` route calls: parse (pydantic, strict JSON), ``check_ops``,
``to_ops`` and ``SQLiteStore.write_batch``. CPU microseconds per span; no HTTP. The
garbage collector is tuned as the server's workers tune it (without that, collections during the
parse add about half again to its figure).

Run: .venv/bin/python bench/breakdown_server_batch.py [--batches 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server_payload import llm_attributes  # noqa: E402

from lightning_rl.records import Rollout, SpanRow  # noqa: E402
from lightning_rl.store import wire  # noqa: E402
from lightning_rl.store.ops import StartRollout, TracedSpan  # noqa: E402
from lightning_rl.store.rows import lift_token_attributes  # noqa: E402
from lightning_rl.store.http.server import _tune_gc  # noqa: E402
from lightning_rl.store.sqlite.store import SQLiteStore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    _tune_gc()
    payloads = [lift_token_attributes(llm_attributes(128, 32, seed)) for seed in range(16)]

    def body(r: int) -> bytes:
        ops = [wire.encode(StartRollout(Rollout(rollout_id=f"r{r}", name="bench")))]
        for seq in range(499):
            attrs, tokens = payloads[seq % 16]
            ops.append(wire.encode(TracedSpan(SpanRow(f"r{r}", seq, 5, seq + 1, None, "chat tiny", "CLIENT", 1, 2,
                                                      "OK", None, attrs, (), tokens))))
        return wire.batch_body(ops)

    bodies = [body(r) for r in range(args.batches)]
    spent = dict.fromkeys(("parse", "check", "items", "write"), 0.0)
    with SQLiteStore(Path(tempfile.mkdtemp(prefix="lrl-bench-")) / "server.db") as store:
        for b in bodies:
            t0 = time.process_time()
            batch = wire.Batch.model_validate_json(b, strict=True)
            t1 = time.process_time()
            errors, _, _, _ = wire.check_ops(batch.ops)
            t2 = time.process_time()
            items = wire.to_ops(batch.ops)
            t3 = time.process_time()
            store.write_batch(items)
            t4 = time.process_time()
            assert not errors
            for name, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                spent[name] += dt
    n = 500 * len(bodies)
    result = {name: round(s * 1e6 / n, 1) for name, s in spent.items()}
    print(f"store server batch handler, CPU us per span ({len(bodies[0]) / 500:.0f} bytes of JSON a span)")
    print(json.dumps({"bench": "breakdown_server_batch", "us_per_span": result}))


if __name__ == "__main__":
    main()
