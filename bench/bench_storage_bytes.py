#!/usr/bin/env python
"""Bytes the SQLite store keeps for one long multi-turn rollout, against its final token sequence.

A 20-turn rollout whose every prompt extends the previous prompt + response + an observation (the
common agent case), growing to about 8k tokens of context. Each turn goes through the OpenAI
adapter's own recording path (a real ``ChatCompletion`` in vLLM's format, with ``prompt_token_ids``,
``token_ids`` and log-probs) into a durable SQLite store. Measured: the bytes of the rollout's span
rows (attributes and events as stored), and the SQLite file's growth. Reference: the rollout's final
token sequence and its response log-probs packed as 32-bit values (4 bytes each). Issue 14's goal is
<= 1.5x (before packed, prefix-shared token columns: 14.0x).

Run: .venv/bin/python bench/bench_storage_bytes.py [--turns 20] [--context 8000]
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import tempfile
from pathlib import Path

import openai
from openai._models import FinalRequestOptions
from openai.types.chat import ChatCompletion

import lightning_rl as lrl
from lightning_rl.adapters.openai import LLMCall
from lightning_rl.tracer import current_rollout


def vllm_response(prompt: list[int], response: list[int]) -> ChatCompletion:
    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
        "prompt_token_ids": prompt,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(response),
                  "total_tokens": len(prompt) + len(response)},
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": response,
                     "message": {"role": "assistant", "content": "x" * len(response)},
                     "logprobs": {"content": [{"token": "x", "logprob": -0.5 - (t % 7) / 8, "bytes": [120],
                                               "top_logprobs": []} for t in response]}}],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--context", type=int, default=8000, help="tokens of context at the last turn")
    parser.add_argument("--first-prompt", type=int, default=400)
    parser.add_argument("--response", type=int, default=100, help="generated tokens per turn")
    args = parser.parse_args()
    # tokens each tool/user observation adds, so that the last turn's prompt + response is about --context
    observation = max(0, (args.context - args.first_prompt - args.turns * args.response) // max(1, args.turns - 1))

    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(151_000) for _ in range(n)]  # noqa: E731  Qwen2-sized vocabulary
    turns, prompt = [], tokens(args.first_prompt)
    for _ in range(args.turns):
        response = tokens(args.response)
        turns.append((prompt, response))
        prompt = prompt + response + tokens(observation)
    final_prompt, final_response = turns[-1]
    generated = args.turns * args.response

    tmp = Path(tempfile.mkdtemp(prefix="lrl-bench-"))
    db = tmp / "bench.db"
    store = lrl.configure(store=f"sqlite:///{db}")
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")
    options = FinalRequestOptions(method="post", url="/chat/completions", json_data={
        "model": "tiny", "max_tokens": args.response, "messages": [{"role": "user", "content": "solve it"}]})

    @lrl.trace
    def agent() -> float:
        state = current_rollout()
        for prompt_ids, response_ids in turns:
            LLMCall(client, options, "chat", state).record_response(vllm_response(prompt_ids, response_ids))
        return 1.0

    store.flush()
    before = db.stat().st_size + (db.with_name(db.name + "-wal").stat().st_size if db.with_name(db.name + "-wal").exists() else 0)
    agent()
    store.close()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    span_bytes, token_bytes = conn.execute(
        "SELECT sum(length(attributes) + coalesce(length(events), 0) + coalesce(length(prompt_ids), 0) "
        "+ coalesce(length(response_ids), 0) + coalesce(length(response_logprobs), 0)), "
        "sum(coalesce(length(prompt_ids), 0) + coalesce(length(response_ids), 0) "
        "+ coalesce(length(response_logprobs), 0)) FROM spans").fetchone()
    conn.close()
    file_growth = db.stat().st_size - before
    final_bytes = 4 * (len(final_prompt) + len(final_response)) + 4 * generated
    with lrl.open_store(f"sqlite:///{db}") as reread:  # what was stored reads back whole
        traj = reread.trajectory(reread.rollouts()[0].rollout_id)
    assert len(traj.llm_calls) == args.turns and traj.llm_calls[-1].prompt_token_ids == final_prompt
    result = {
        "bench": "storage_bytes", "turns": args.turns, "final_context_tokens": len(final_prompt) + len(final_response),
        "generated_tokens": generated, "final_sequence_bytes": final_bytes, "span_row_bytes": span_bytes,
        "token_column_bytes": token_bytes, "ratio_token_columns": round(token_bytes / final_bytes, 2),
        "sqlite_file_growth_bytes": file_growth, "ratio_span_rows": round(span_bytes / final_bytes, 2),
        "ratio_file_growth": round(file_growth / final_bytes, 2), "target_ratio_max": 1.5,
    }
    print(f"\n{args.turns}-turn rollout, {result['final_context_tokens']} tokens of final context")
    print(f"  final sequence + response log-probs, 32-bit packed : {final_bytes:>12,} bytes")
    print(f"  token columns (packed, prefix-shared)               : {token_bytes:>12,} bytes "
          f"({result['ratio_token_columns']}x)")
    print(f"  span rows as stored (attributes, events, tokens)    : {span_bytes:>12,} bytes "
          f"({result['ratio_span_rows']}x)")
    print(f"  SQLite file growth                                  : {file_growth:>12,} bytes "
          f"({result['ratio_file_growth']}x)")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
