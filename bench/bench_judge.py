#!/usr/bin/env python
"""What the group judge costs per group (issue 19): the tiny model judging on this CPU machine.

A vLLM server serves the tiny model; ``GroupJudge`` scores ``--groups`` groups of ``--n`` answers each
(calculator answers, right and wrong), one request per group. Reported per group: the wall time of a
judged group (uncached), of a cached one, and the judge's prompt and answer tokens. The baseline in the
same run: one of the agent's own calls (the calculator agent's first call, the same server), so the
judge's cost reads as "this many agent calls per group".

Run: .venv/bin/python bench/bench_judge.py [--groups 10] [--n 8] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_rl.judge import GroupJudge  # noqa: E402
from lightning_rl.vllm_server import VLLMServer  # noqa: E402

RUBRIC = "The task is an addition. Score 1 for the exact sum, 0 otherwise."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-qwen2"))
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    with VLLMServer(model=args.model_dir) as server:
        judge = GroupJudge(base_url=server.base_url, model=server.served_name, rubric=RUBRIC)
        agent_call = {"model": server.served_name, "temperature": 0.0, "max_tokens": 64, "seed": 0,
                      "messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 31+12?"}],
                      "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {
                          "type": "object", "properties": {"expression": {"type": "string"}}}}}]}
        baseline = []
        for _ in range(args.groups):
            t0 = time.perf_counter()
            httpx.post(server.base_url + "/chat/completions", json=agent_call, timeout=120).raise_for_status()
            baseline.append(time.perf_counter() - t0)
        uncached, cached, prompt_tokens, failures = [], [], [], 0
        for g in range(args.groups):
            a, b = 10 + g, 30 + 2 * g
            answers = [str(a + b + (k % 3) - 1) for k in range(args.n)]  # right and off by one
            task = {"question": f"What is {a}+{b}?"}
            t0 = time.perf_counter()
            scores, _ = judge.score(task, answers)
            uncached.append(time.perf_counter() - t0)
            failures += scores is None
            t0 = time.perf_counter()
            judge.score(task, answers)
            cached.append(time.perf_counter() - t0)
            counted = httpx.post(server.url + "/tokenize", json={"model": server.served_name,
                                                                 "messages": judge.prompt(task, answers)}, timeout=60)
            prompt_tokens.append(counted.json().get("count", 0) if counted.status_code == 200 else 0)
    summary = {
        "groups": args.groups, "n": args.n, "judge_failures": failures,
        "judged_group_s_p50": round(statistics.median(uncached), 3),
        "cached_group_ms_p50": round(statistics.median(cached) * 1000, 3),
        "agent_call_s_p50": round(statistics.median(baseline), 3),
        "agent_calls_per_judged_group": round(statistics.median(uncached) / statistics.median(baseline), 2),
        "judge_prompt_tokens_p50": statistics.median(prompt_tokens),
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
