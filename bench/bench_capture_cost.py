#!/usr/bin/env python
"""What tracing adds to one LLM call, through the public API, against a bare empty OpenTelemetry span.

An ``openai.OpenAI`` client talks to an in-process transport (``httpx.MockTransport``) that answers
every request with the bytes a vLLM server sends for it: ``prompt_token_ids`` and ``token_ids`` when it
asked for ``return_token_ids``, log-probs when it asked for ``logprobs``, for ``P`` prompt and ``R``
response tokens (until 2026-11-27 every answer carried them, asked or not: the untraced calls then paid
the client's parsing of fields only tracing asks for, up to 5 ms a call at 4,000+1,000). The log-probs are
float32 values, as vLLM's are (it computes them in float32); before 2026-11-27 any double, which made the
packer try float32 and then store float64. All of it runs inside one ``@trace`` rollout
into a durable SQLite store, and blocks of N calls alternate in every round:

* ``untraced``: N calls run in an empty ``contextvars.Context()`` (no rollout: the client's own cost,
  HTTP, JSON, pydantic, with our wrappers passing through);
* ``traced``: the same N calls recorded, then ``store.flush()``: every row is on disk, and the
  writer thread's work for them is timed in this block;
* ``bare``: N empty spans started and ended on an OpenTelemetry SDK ``TracerProvider``;
* ``spanned``: the untraced block with one such empty span around each call (issue 46): what the
  cheapest instrumentation there is costs *inside* a client call, where the CPU's caches hold the
  client's code and data, not the span's. ``bare`` runs hot (the same few lines in a tight loop); code run
  between a client's own work runs colder (measured 2026-11-27: 8.4 us hot, 17.9 us in situ at 40+4).

"Tracing adds" is (traced - untraced) / N per round, and "a span in situ" (spanned - untraced) / N, CPU time of the whole process (the writer
thread included); the median over many short rounds (41 of about 10,000 tokens' worth of calls)
holds against the machine's drift, which longer blocks (7 rounds of 400,000 tokens, before issue
33) did not: their single rounds ranged from below 0 to 1,500 us. Each call's prompt differs from
the previous one (9 payloads in turn: one more than the 8 recent calls the writer compares a prompt
with), so prefix sharing finds nothing and every call pays for its full prompt: this is the worst case.

Run: .venv/bin/python bench/bench_capture_cost.py [--shapes 40+4,512+128,4000+1000,32000+1000]
"""

from __future__ import annotations

import argparse
import contextvars
import json
import random
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
from opentelemetry.sdk.trace import TracerProvider

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_rounds, summary  # noqa: E402

import lightning_rl as lrl  # noqa: E402

PAYLOADS = 9  # > tokens.CANDIDATES_PER_ROLLOUT: no earlier prompt of the rollout is found again


def vllm_body(prompt: int, response: int, seed: int, *, ids: bool = True, logprobs: bool = True) -> bytes:
    """A chat completion as vLLM sends it: with the token ids (``return_token_ids``) and log-probs
    (``logprobs``) when asked for them, else ``prompt_token_ids``/``token_ids`` null and no log-probs."""
    rng = random.Random(seed)
    response_ids = [rng.randrange(151_000) for _ in range(response)]
    # vLLM computes log-probs in float32 and writes those values as JSON numbers: float32 values, not any double
    values = [struct.unpack("<f", struct.pack("<f", -rng.random() * 4))[0] for _ in response_ids]
    prompt_ids = [rng.randrange(151_000) for _ in range(prompt)]
    return orjson.dumps({
        "id": f"chatcmpl-{seed}", "object": "chat.completion", "created": 0, "model": "tiny",
        "prompt_token_ids": prompt_ids if ids else None,
        "usage": {"prompt_tokens": prompt, "completion_tokens": response, "total_tokens": prompt + response},
        "choices": [{
            "index": 0, "finish_reason": "length", "token_ids": response_ids if ids else None,
            "message": {"role": "assistant", "content": "x" * response},
            "logprobs": {"content": [{"token": "x", "logprob": lp, "bytes": [120], "top_logprobs": []}
                                     for lp in values]} if logprobs else None,
        }],
    })


def answers(prompt: int, response: int) -> Any:
    """An httpx handler answering each request as vLLM would: token fields only when the request asked."""
    bodies = {(ids, lps): [vllm_body(prompt, response, seed, ids=ids, logprobs=lps) for seed in range(PAYLOADS)]
              for ids in (False, True) for lps in (False, True)}
    turn = [0]

    def answer(request: httpx.Request) -> httpx.Response:
        turn[0] += 1
        sent = orjson.loads(request.content)
        asked = (bool(sent.get("return_token_ids")), bool(sent.get("logprobs")))
        return httpx.Response(200, content=bodies[asked][turn[0] % PAYLOADS],
                              headers={"content-type": "application/json"})

    return answer


def measure(prompt: int, response: int, calls: int, rounds: int, tmp: Path) -> dict:
    client = openai.OpenAI(base_url="http://vllm.local:8000/v1", api_key="EMPTY", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(answers(prompt, response))))
    messages = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": "What is 12+30?"}]
    store = lrl.configure(store=f"sqlite:///{tmp / f'capture-{prompt}-{response}.db'}")

    def block() -> int:
        for _ in range(calls):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=response, temperature=1.0)
        return calls

    def traced() -> int:
        block()
        store.flush()  # the writer thread's work for these calls is done, and timed, in this block
        return calls

    def untraced() -> int:
        return contextvars.Context().run(block)  # an empty context: no rollout, nothing recorded

    tracer = TracerProvider().get_tracer("bench")

    def bare() -> int:
        for _ in range(calls * 4):  # cheap: more of them for a steadier figure
            tracer.start_span("bare").end()
        return calls * 4

    def spanned_block() -> int:
        for _ in range(calls):
            span = tracer.start_span("bare")
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=response, temperature=1.0)
            span.end()
        return calls

    def spanned() -> int:
        return contextvars.Context().run(spanned_block)  # no rollout: only the empty span is added

    @lrl.trace
    def agent() -> dict:
        traced(), untraced()  # warm-up (the schema, the writer thread, the adapter's server table)
        return cpu_rounds({"untraced": untraced, "traced": traced, "bare": bare, "spanned": spanned}, rounds,
                          collect=True)

    results = agent()
    adds = [t - u for t, u in zip(results["traced"], results["untraced"])]
    ratios = [a / b for a, b in zip(adds, results["bare"])]
    in_situ = [s - u for s, u in zip(results["spanned"], results["untraced"])]
    (rollout,) = [r for r in store.rollouts() if r.status == "succeeded"][-1:]
    rows = len(store.spans(rollout.rollout_id))
    expected = (rounds + 1) * calls + 1
    last = lrl.trajectory(store, rollout.rollout_id).llm_calls[-1]
    assert len(last.prompt_token_ids) == prompt and len(last.response_token_ids) == response, "tokens not recorded"
    assert last.response_logprobs is not None and len(last.response_logprobs) == response
    store.close()
    return {
        "prompt_tokens": prompt, "response_tokens": response, "calls_per_block": calls, "rounds": rounds,
        "untraced_call_us": summary(results["untraced"]), "traced_call_us": summary(results["traced"]),
        "tracing_adds_us": summary(adds), "bare_empty_span_us": summary(results["bare"]),
        "ratio": summary(ratios), "bare_span_in_situ_us": summary(in_situ),
        "ratio_in_situ": summary(adds)["median"] / summary(in_situ)["median"], "ns_per_token": round(summary(adds)["median"] * 1000 / (prompt + response), 1),
        "rows_on_disk": rows, "rows_expected": expected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="40+4,512+128,4000+1000,32000+1000")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--tokens-per-block", type=int, default=10_000,
                        help="calls per block = this / tokens per call (at least 5, at most 200)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lrl-bench-"))
    targets = {"40+4": 3.0, "4000+1000": 10.0}
    print("\nwhat tracing adds to one LLM call (CPU us), against a bare empty OTel SDK span, same run")
    print(f"{'shape':>12} {'untraced':>10} {'adds':>10} {'bare':>7} {'ratio':>7} {'in situ':>8} {'ratio':>7} "
          f"{'ns/token':>9} {'target':>7}")
    out = []
    for shape in args.shapes.split(","):
        prompt, response = (int(x) for x in shape.split("+"))
        calls = max(5, min(200, args.tokens_per_block // (prompt + response)))
        r = measure(prompt, response, calls, args.rounds, tmp)
        r["shape"], r["target_ratio_max"] = shape, targets.get(shape)
        out.append(r)
        target = f"<= {targets[shape]:g}" if shape in targets else ""
        print(f"{shape:>12} {r['untraced_call_us']['median']:10.1f} {r['tracing_adds_us']['median']:10.1f} "
              f"{r['bare_empty_span_us']['median']:7.1f} {r['ratio']['median']:7.1f} "
              f"{r['bare_span_in_situ_us']['median']:8.1f} {r['ratio_in_situ']:7.1f} {r['ns_per_token']:9.1f} {target:>7}")
        assert r["rows_on_disk"] == r["rows_expected"], f"rows lost: {r['rows_on_disk']} of {r['rows_expected']}"
    print(json.dumps({"bench": "capture_cost", "shapes": out}))


if __name__ == "__main__":
    main()
