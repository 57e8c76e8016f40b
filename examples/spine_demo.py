#!/usr/bin/env python
"""The spine, end to end: a traced agent calls a real vLLM server; its trajectories are on disk.

1. Creates the tiny model (`make model`: scripts/make_tiny_model.py) if it is missing and serves it with vLLM (CPU).
2. Runs a two-turn calculator agent (plain OpenAI client) under @lrl.trace, sync and async:
   the model answers, the agent feeds back a calculator result, the model answers again,
   and the agent returns 1.0 when the final answer contains the right number.
3. Adds late user feedback to one rollout, shows one trajectory the way `lightning-rl rollouts show`
   does, and exports trajectory-level training samples as JSON lines.
4. Ends with one JSON line (rollouts, llm_calls, samples, token-id coverage, minutes, peak RSS).

The tiny model is warm-started (scripts/make_tiny_model.py trains it on synthetic calculator conversations, so it
knows the tool-call format), not trained for this two-turn exchange: the point is what is captured, not what it
answers (`make demo` trains it with RL).
Run: make demo-spine    (or: python examples/spine_demo.py --model-dir .cache/tiny-qwen2)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import time
from pathlib import Path

import openai

import lightning_rl as lrl
from lightning_rl.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent


def make_tasks(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"a": rng.randint(10, 99), "b": rng.randint(10, 99)} for _ in range(n)]


def build_agents(client: openai.OpenAI, aclient: openai.AsyncOpenAI, model: str):
    def turns(task: dict) -> list[dict]:
        return [{"role": "system", "content": "Answer with the sum. A calculator result may follow."},
                {"role": "user", "content": f"What is {task['a']}+{task['b']}?"}]

    @lrl.trace(agent="calculator")
    def calculator_agent(task: dict) -> float:
        messages = turns(task)
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=1.0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": f"calculator: {task['a'] + task['b']}"}]
        lrl.emit_reward(0.1 if any(ch.isdigit() for ch in first.choices[0].message.content) else 0.0, name="format")
        final = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=1.0)
        return 1.0 if str(task["a"] + task["b"]) in final.choices[0].message.content else 0.0

    @lrl.trace(agent="calculator")
    async def calculator_agent_async(task: dict) -> float:
        messages = turns(task)
        stream = await aclient.chat.completions.create(model=model, messages=messages, max_tokens=16, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"calculator: {task['a'] + task['b']}"}]
        final = await aclient.chat.completions.create(model=model, messages=messages, max_tokens=16)
        return 1.0 if str(task["a"] + task["b"]) in final.choices[0].message.content else 0.0

    return calculator_agent, calculator_agent_async


def main() -> None:
    parser = argparse.ArgumentParser(description="lightning-rl spine demo")
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-qwen2"))
    parser.add_argument("--out", default=str(ROOT / ".cache" / "demo"))
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--base-url", default=os.environ.get("LIGHTNING_RL_DEMO_BASE_URL"),
                        help="Use a running OpenAI-compatible server instead of starting vLLM.")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "runs.db"
    for suffix in ("", "-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)

    if not (Path(args.model_dir) / "config.json").exists():
        subprocess.run(["make", "-C", str(ROOT), "model"], check=True)

    server = None
    if args.base_url is None:
        print(f"starting vLLM (CPU) on {args.model_dir} ...", flush=True)
        server = lrl.VLLMServer(model=args.model_dir, served_name=args.model, log_path=out / "vllm.log").start()
        base_url = server.base_url
        print(f"vLLM ready at {base_url} in {time.time() - started:.0f}s", flush=True)
    else:
        base_url = args.base_url
    try:
        store = lrl.configure(store=f"sqlite:///{db}")
        client = openai.OpenAI(base_url=base_url, api_key="EMPTY")
        aclient = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY")
        sync_agent, async_agent = build_agents(client, aclient, args.model)
        tasks = make_tasks(args.tasks)
        half = len(tasks) // 2
        for task in tasks[:half]:
            sync_agent(task)

        async def run_async() -> None:
            await asyncio.gather(*(async_agent(task) for task in tasks[half:]))

        asyncio.run(run_async())
        first = store.rollouts()[0]
        store.add_reward(first.rollout_id, 1.0, name="user_feedback")  # arrives after the rollout ended

        print(f"\n=== one trajectory (lightning-rl rollouts show {first.rollout_id} --store {db}) ===")
        cli(["rollouts", "show", first.rollout_id, "--store", str(db)], standalone_mode=False)
        samples_path = out / "samples.jsonl"
        print(f"\n=== export (lightning-rl export --level trajectory --store {db} -o {samples_path}) ===")
        cli(["export", "--level", "trajectory", "--store", str(db), "-o", str(samples_path)], standalone_mode=False)

        trajectories = list(lrl.trajectories(store))
        calls = [c for t in trajectories for c in t.llm_calls]
        with_ids = sum(1 for c in calls if c.token_ids_source == "engine")
        samples, stats = lrl.samples(store, level="trajectory")
        summary = {
            "rollouts": len(trajectories),
            "succeeded": sum(t.status == "succeeded" for t in trajectories),
            "llm_calls": len(calls),
            "llm_calls_with_engine_token_ids": with_ids,
            "mean_reward": sum(t.final_reward or 0.0 for t in trajectories) / max(1, len(trajectories)),
            "trajectory_samples": len(samples),
            "prefix_splits": stats.splits,
            "store": str(db),
            "samples": str(samples_path),
            "minutes": round((time.time() - started) / 60, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
        print(f"\n{len(trajectories)} rollouts, {len(calls)} LLM calls, {with_ids} with engine token ids, "
              f"{len(samples)} trajectory samples ({stats.splits} prefix splits); store at {db}")
        print(json.dumps(summary))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
