#!/usr/bin/env python
"""CPU cost of one traced LLM-call span through to a durable SQLite row, against a bare OTel SDK span.

Measured: inside a rollout, the OpenAI adapter's own code path for one chat call (request
attributes, a real ``ChatCompletion`` parsed from a vLLM response with 512 prompt and 128
response token ids plus logprobs), our span processor, the bounded writer queue, JSON encoding and
the batched SQLite insert, with a flush at the end of each block so every row is on disk.
Baseline: creating and ending a span with an OpenTelemetry SDK TracerProvider (no processor)
carrying the same final attributes. Blocks alternate; CPU time (all threads). Target: ratio <= 3.

Run: .venv/bin/python bench/bench_span_cost.py [--spans 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import openai
from openai._models import FinalRequestOptions
from openai.types.chat import ChatCompletion
from opentelemetry.sdk.trace import TracerProvider

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import adapter_call, cpu_rounds, report, summary  # noqa: E402

import lightning_rl as lrl  # noqa: E402


def chat_request() -> tuple[openai.OpenAI, FinalRequestOptions]:
    """A client and the options of one chat request, as the OpenAI client hands them to ``request``."""
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")
    body = {"model": "tiny", "max_tokens": 128, "temperature": 1.0,
            "messages": [{"role": "system", "content": "You are a helpful agent."},
                         {"role": "user", "content": "What is 12+30? " * 8}]}
    return client, FinalRequestOptions(method="post", url="/chat/completions", json_data=body)


def fake_vllm_response(prompt_len: int, response_len: int) -> ChatCompletion:
    rng = random.Random(0)
    ids = [rng.randrange(100) for _ in range(response_len)]
    payload = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
        "prompt_token_ids": [rng.randrange(100) for _ in range(prompt_len)],
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": response_len, "total_tokens": prompt_len + response_len},
        "choices": [{
            "index": 0, "finish_reason": "stop", "token_ids": ids,
            "message": {"role": "assistant", "content": "x" * response_len},
            "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []} for _ in ids]},
        }],
    }
    return ChatCompletion.model_validate(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--response-tokens", type=int, default=128)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="lrl-bench-"))
    store = lrl.configure(store=f"sqlite:///{tmp / 'bench.db'}")
    client, options = chat_request()
    response = fake_vllm_response(args.prompt_tokens, args.response_tokens)

    @lrl.trace
    def traced_block(n: int) -> int:
        for _ in range(n):
            adapter_call(client, options).record_response(response)
        return n

    def ours() -> int:
        traced_block(args.spans)  # the decorator flushes: every row is on disk when it returns
        return args.spans

    # The baseline span carries exactly the attributes our span ends with.
    ours()
    rid = store.rollouts()[-1].rollout_id
    attributes = store.spans(rid)[1].attributes
    bare = TracerProvider().get_tracer("bench")

    def baseline() -> int:
        for _ in range(args.spans):
            bare.start_span("chat tiny", attributes=attributes).end()
        return args.spans

    results = cpu_rounds({"baseline": baseline, "ours": ours}, args.rounds)
    ratios = [o / b for o, b in zip(results["ours"], results["baseline"])]
    rows_on_disk = sum(len(store.spans(r.rollout_id)) for r in store.rollouts())
    expected = (args.rounds + 1) * (args.spans + 1)
    result = {
        "bench": "span_cost", "spans_per_block": args.spans, "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
        "baseline_us": summary(results["baseline"]), "ours_us": summary(results["ours"]),
        "ratio": summary(ratios), "target_ratio_max": 3.0, "rows_on_disk": rows_on_disk,
        "rows_expected": expected, "meets_target": summary(ratios)["median"] <= 3.0 and rows_on_disk == expected,
    }
    report("traced LLM-call span -> durable SQLite row, vs bare OTel SDK span (CPU us per span)", [
        ("bare OpenTelemetry SDK span, same attributes (baseline)", summary(results["baseline"]), "us"),
        ("lightning-rl: adapter span -> processor -> queue -> SQLite", summary(results["ours"]), "us"),
        ("ratio ours / baseline (per round)", summary(ratios), "x"),
    ], result)


if __name__ == "__main__":
    main()
