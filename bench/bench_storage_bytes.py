#!/usr/bin/env python
"""Bytes the SQLite store keeps per multi-turn rollout with realistic message text, against a packed reference.

A chat agent inside one ``@lrl.trace`` rollout runs N turns through a real ``openai.OpenAI`` client
whose transport (``httpx.MockTransport``) answers like vLLM (``prompt_token_ids``, ``token_ids``,
log-probs). Messages start with a system message and a user task; each turn appends the assistant
message as returned and an observation, so every prompt extends the previous prompt + response +
observation. Text is seeded random words, about 4 characters per token: first prompt 400 tokens,
100 generated per turn, observations sized so that 20 turns end near 8,000 tokens of context (the
same observation size at 50 turns, which so ends larger). The transport's prompt ids stay consistent:
turn k+1's prompt ids are turn k's prompt + response ids, then the observation's new ids.

Reference ("packed final tokens + one copy of the text"): 4 bytes * (final prompt + final response
tokens) + 4 bytes * every generated token (response log-probs as float32) + the UTF-8 length of the
final conversation text once (compact JSON of the last turn's input messages + the last reply's text).
Measured after ``store.close()`` and ``PRAGMA wal_checkpoint(TRUNCATE)``: the bytes of all span rows
(length() of every non-numeric column of ``spans``, found by ``PRAGMA table_info``), the token columns
alone, and the SQLite file's growth over the rollout. Issue 14's goal is <= 1.5x.

Run: .venv/bin/python bench/bench_storage_bytes.py [--turns 20 | --all] [--context 8000]
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import struct
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import orjson

import lightning_rl as lrl

def float32(x: float) -> float:
    """A log-prob as vLLM sends it: computed in float32, written as the double that holds it exactly."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


TOKEN_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs")


def text_maker(rng: random.Random):
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))) for _ in range(3000)]

    def text(tokens: int) -> str:  # about 4 characters per token
        words, size = [], 0
        while size < 4 * tokens:
            words.append(rng.choice(vocab))
            size += len(words[-1]) + 1
        return " ".join(words)[: 4 * tokens]
    return text


def vllm_handler(first_prompt: int, response: int, observation: int, sent: dict):
    """Answers /chat/completions like vLLM; keeps each conversation's running token ids (keyed by its task)."""
    rng, text = random.Random(1), text_maker(random.Random(2))
    ids = lambda n: [rng.randrange(151_000) for _ in range(n)]  # noqa: E731  Qwen2-sized vocabulary
    running: dict[str, list[int]] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key = body["messages"][1]["content"]
        prompt = running[key] + ids(observation) if key in running else ids(first_prompt)
        out, content = ids(response), text(response)
        running[key] = prompt + out
        sent["prompt_ids"], sent["messages"] = prompt, body["messages"]
        pieces = [content[4 * i: 4 * i + 4] for i in range(response - 1)] + [content[4 * (response - 1):]]
        return httpx.Response(200, content=orjson.dumps({
            "id": f"chatcmpl-{len(running[key])}", "object": "chat.completion", "created": 0, "model": "tiny",
            "prompt_token_ids": prompt,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": response,
                      "total_tokens": len(prompt) + response},
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": out,
                         "message": {"role": "assistant", "content": content},
                         "logprobs": {"content": [{"token": p, "logprob": float32(-rng.random() * 4), "bytes": list(p.encode()),
                                                   "top_logprobs": []} for p in pieces]}}],
        }), headers={"content-type": "application/json"})
    return answer


def file_size(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return db.stat().st_size


def run(turns: int, context: int, first_prompt: int, response: int, observation: int) -> dict:
    db = Path(tempfile.mkdtemp(prefix="lrl-bench-")) / "bench.db"
    store = lrl.configure(store=f"sqlite:///{db}")
    sent: dict = {}
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY", max_retries=0, http_client=httpx.Client(
        transport=httpx.MockTransport(vllm_handler(first_prompt, response, observation, sent))))
    text = text_maker(random.Random(0))

    @lrl.trace
    def agent() -> str:
        messages = [{"role": "system", "content": text(first_prompt // 4)},
                    {"role": "user", "content": text(first_prompt - first_prompt // 4)}]
        for turn in range(turns):
            resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=response)
            if turn < turns - 1:
                messages = messages + [{"role": "assistant", "content": resp.choices[0].message.content},
                                       {"role": "user", "content": text(observation)}]
        sent["reply"] = resp.choices[0].message.content
        return lrl.current_rollout_id()

    store.flush()
    before = file_size(db)
    rollout_id = agent()
    store.close()
    growth = file_size(db) - before
    with sqlite3.connect(db) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(spans)")
                   if not any(t in row[2].upper() for t in ("INT", "REAL", "FLOA", "DOUB", "NUM"))]
        total = lambda cols: conn.execute(  # noqa: E731
            "SELECT coalesce(sum(" + " + ".join(f"coalesce(length({c}), 0)" for c in cols) + "), 0) FROM spans").fetchone()[0]
        span_bytes, token_bytes = total(columns), total([c for c in TOKEN_COLUMNS if c in columns])
    conn.close()
    final_tokens = len(sent["prompt_ids"]) + response
    text_bytes = len(orjson.dumps(sent["messages"])) + len(sent["reply"].encode())
    reference = 4 * final_tokens + 4 * turns * response + text_bytes
    with lrl.open_store(f"sqlite:///{db}") as reread:  # what was stored reads back whole
        calls = lrl.trajectory(reread, rollout_id).llm_calls
    if len(calls) != turns:
        sys.exit(f"MISMATCH ({turns} turns): {len(calls)} LLM calls read back (records quarantined? "
                 f"see `lightning-rl store doctor --store {db}`)")
    last = calls[-1]
    if last.input_messages != sent["messages"]:
        sys.exit(f"MISMATCH ({turns} turns): stored input_messages of the last call differ from those sent "
                 f"({len(last.input_messages)} stored vs {len(sent['messages'])} sent messages)")
    if last.prompt_token_ids != sent["prompt_ids"]:
        sys.exit(f"MISMATCH ({turns} turns): stored prompt_token_ids of the last call differ from those sent "
                 f"({len(last.prompt_token_ids)} stored vs {len(sent['prompt_ids'])} sent)")
    return {
        "bench": "storage_bytes", "turns": turns, "final_context_tokens": final_tokens,
        "generated_tokens": turns * response, "observation_tokens_per_turn": observation,
        "final_text_bytes": text_bytes, "reference_bytes": reference, "span_row_bytes": span_bytes,
        "token_column_bytes": token_bytes, "sqlite_file_growth_bytes": growth,
        "ratio_span_rows": round(span_bytes / reference, 2), "ratio_token_columns": round(token_bytes / reference, 2),
        "ratio_file_growth": round(growth / reference, 2), "target_ratio_max": 1.5, "span_columns": columns,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--all", action="store_true", help="run 20 and 50 turns, one after the other")
    parser.add_argument("--context", type=int, default=8000, help="tokens of context at the last of 20 turns")
    parser.add_argument("--first-prompt", type=int, default=400)
    parser.add_argument("--response", type=int, default=100, help="generated tokens per turn")
    args = parser.parse_args()
    # tokens each observation adds, so that 20 turns end with about --context tokens (same size at any --turns)
    observation = max(0, (args.context - args.first_prompt - 20 * args.response) // 19)
    for turns in ([20, 50] if args.all else [args.turns]):
        r = run(turns, args.context, args.first_prompt, args.response, observation)
        print(f"\n{turns}-turn rollout, {r['final_context_tokens']:,} tokens of final context "
              f"({observation} observation tokens per turn)")
        print(f"  reference: packed final tokens + log-probs + text once : {r['reference_bytes']:>12,} bytes "
              f"(text {r['final_text_bytes']:,})")
        print(f"  token columns (prompt_ids, response_ids, logprobs)     : {r['token_column_bytes']:>12,} bytes "
              f"({r['ratio_token_columns']}x)")
        label = f"span rows as stored ({len(r['span_columns'])} text/blob columns)"
        print(f"  {label:<55}: "
              f"{r['span_row_bytes']:>12,} bytes ({r['ratio_span_rows']}x)")
        print(f"  SQLite file growth                                     : {r['sqlite_file_growth_bytes']:>12,} bytes "
              f"({r['ratio_file_growth']}x, target <= {r['target_ratio_max']}x)")
        print(json.dumps(r))


if __name__ == "__main__":
    main()
