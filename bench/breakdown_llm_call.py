#!/usr/bin/env python
"""Where one traced LLM call's fixed cost goes: the adapter's steps and the store writer's, timed apart.

N ``LLMCall`` objects on a real vLLM-shaped ``ChatCompletion`` (40+4 tokens by default) inside one
rollout: creating them (request attributes, span start), reading the response, finishing them (span
attributes, ``span.end()``, our processor, a sink that only keeps the row), then the SQLite store's
writer steps on those rows: encoding, the prefix check, and ``_apply`` (encoding + prefix check + the
batched insert, 100 rows a transaction). For scale: a bare empty OTel SDK span, and an SDK span
carrying the same attributes with no processor (the floor while the span carries them). CPU us per call.

Run: .venv/bin/python bench/breakdown_llm_call.py [--prompt-tokens 40] [--response-tokens 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_span_cost import chat_request, fake_vllm_response  # noqa: E402

import lightning_rl as lrl  # noqa: E402
from _common import adapter_call  # noqa: E402
from lightning_rl.store.ops import TracedSpan  # noqa: E402
from lightning_rl.store.rows import span_values  # noqa: E402
from lightning_rl.tracer.provider import tracing  # noqa: E402


class _KeepRows:
    def __init__(self) -> None:
        self.rows = []

    def write_span(self, row) -> None:
        self.rows.append(row)

    def flush(self, timeout=None) -> bool:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--response-tokens", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    n = args.calls
    store = lrl.configure(store=f"sqlite:///{Path(tempfile.mkdtemp(prefix='lrl-bench-')) / 'b.db'}")
    client, options = chat_request()
    response = fake_vllm_response(args.prompt_tokens, args.response_tokens)
    out: dict[str, float] = {}
    keep = _KeepRows()

    @lrl.trace
    def block() -> None:
        t0 = time.process_time()
        calls = [adapter_call(client, options) for _ in range(n)]
        t1 = time.process_time()
        for c in calls:
            c.read_response(response)
        t2 = time.process_time()
        real, tracing._sink = tracing._sink, keep
        try:
            for c in calls:
                c.finish()
        finally:
            tracing._sink = real
        t3 = time.process_time()
        out.update(start=(t1 - t0), read=(t2 - t1), finish=(t3 - t2))

    block()  # warm-up
    keep.rows.clear()
    block()
    rows = [dataclasses.replace(r, rollout_id="copy-" + r.rollout_id) for r in keep.rows]
    t0 = time.process_time()
    encoded = [span_values(r) for r in rows]
    t1 = time.process_time()
    for values in encoded:
        store._durable.sharer.share(values)
    t2 = time.process_time()
    rows = [dataclasses.replace(r, rollout_id="apply-" + r.rollout_id) for r in keep.rows]
    t3 = time.process_time()
    for i in range(0, n, 100):
        store._durable._apply([TracedSpan(r) for r in rows[i:i + 100]])
    t4 = time.process_time()
    out.update(encode=(t1 - t0), prefix_check=(t2 - t1), writer_apply=(t4 - t3))
    bare = TracerProvider().get_tracer("bench")
    t0 = time.process_time()
    for _ in range(n * 4):
        bare.start_span("bare").end()
    out["bare_empty_span"] = (time.process_time() - t0) / 4
    # The floor the adapter cannot go below while the span carries the GenAI attributes: an SDK span
    # with the same attributes (set as the adapter sets them, at start and at end), no processor.
    attributes = dict(keep.rows[0].attributes)
    at_end = {k: attributes.pop(k) for k in list(attributes) if k.startswith(("gen_ai.response", "gen_ai.usage",
                                                                               "gen_ai.output", "lightning_rl.token"))}
    t0 = time.process_time()
    for _ in range(n):
        span = bare.start_span("chat tiny", attributes=attributes)
        span.set_attributes(at_end)
        span.end()
    out["sdk_span_same_attributes"] = time.process_time() - t0
    result = {k: round(v * 1e6 / n, 1) for k, v in out.items()}
    print(f"one traced LLM call ({args.prompt_tokens}+{args.response_tokens} tokens), CPU us per call")
    print(json.dumps({"bench": "breakdown_llm_call", "us_per_call": result}))


if __name__ == "__main__":
    main()
