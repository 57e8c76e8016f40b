#!/usr/bin/env python
"""SFT, then GRPO, on the main demo's calculator task (the recipe of issue 19: start from good traces).

1. vLLM serves the tiny model with LoRA hot-loading (as in ``train.py``).
2. Collect: the base model runs the calculator agent on ``--collect-tasks`` training tasks,
   ``--collect-n`` tries each at temperature 1, traced into the store.
3. Export the successful tries as conversations (``chat_examples``: what ``lightning-rl export
   --format chat --min-reward 1`` writes).
4. ``Trainer.sft`` warm-starts the LoRA on them; ``Trainer.fit`` then runs GRPO from it. Its
   held-out success at step 0 is the SFT policy's; at the end, after GRPO.
5. One JSON line: held-out success of the base model (greedy), after SFT, after GRPO.

Run: make demo-sft     (or .venv/bin/python examples/calculator_rl/sft_then_rl.py --steps 8)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning_rl as lrl  # noqa: E402
from lightning_rl.store.export import chat_examples  # noqa: E402
from train import add_training_arguments, demo_tasks, fresh_run, make_agent, peak_rss_mb, serve_with_lora  # noqa: E402


async def _run_all(agent, tasks: list[dict], concurrency: int = 16) -> list[float]:
    """Run the agent once per task; the k-th try of a task is attempt k (the agent's seed depends on it)."""
    gate = asyncio.Semaphore(concurrency)
    seen: dict[str, int] = {}

    async def one(task: dict, attempt: int) -> float:
        async with gate:
            with lrl.rollout_overrides(attempt=attempt):
                return float(await agent(task))

    runs = []
    for task in tasks:
        key = json.dumps(task, sort_keys=True)
        runs.append(one(task, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return await asyncio.gather(*runs)


def main() -> None:
    parser = argparse.ArgumentParser(description="SFT then GRPO on the calculator task (CPU)")
    add_training_arguments(parser, "demo-sft")
    parser.add_argument("--collect-tasks", type=int, default=32, help="training tasks the base model tries")
    parser.add_argument("--collect-n", type=int, default=8, help="tries per task while collecting")
    parser.add_argument("--sft-epochs", type=int, default=3)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    args = parser.parse_args()
    started = time.time()
    out = fresh_run(args.out, args.model_dir)
    held_out, train_tasks = demo_tasks(args.eval_tasks, args.seed)
    with contextlib.ExitStack() as stack:
        server = serve_with_lora(stack, args.model_dir, out)
        store = lrl.configure(store=f"sqlite:///{out / 'runs.db'}")
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        base = server.served_name

        collect = [t for t in train_tasks[-args.collect_tasks:] for _ in range(args.collect_n)]

        async def before_training() -> tuple[list[float], float]:
            # a client of its own: an AsyncOpenAI client stays on the event loop it first ran on
            own = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
            tries = await _run_all(make_agent(own, base, temperature=1.0), collect)
            with lrl.rollout_overrides(mode="eval"):  # the base model's held-out success, greedy, not SFT data
                greedy = await _run_all(make_agent(own, base, temperature=0.0), held_out)
            return tries, sum(greedy) / len(held_out)

        collected, base_success = asyncio.run(before_training())
        store.flush()
        examples, stats = chat_examples(store, mode="train", min_reward=1.0)
        print(f"collected {len(collect)} tries of the base model, {sum(collected):.0f} right; "
              f"{len(examples)} conversations for SFT", flush=True)

        trainer = lrl.Trainer(
            agent=make_agent(client, "policy", temperature=1.0), tasks=train_tasks[:-args.collect_tasks], store=store,
            model_dir=args.model_dir, server_url=server.url, out_dir=out, n=args.n,
            tasks_per_step=args.tasks_per_step, steps=args.steps, eval_tasks=held_out, eval_n=1,
            eval_agent=make_agent(client, "policy", temperature=0.0), local=lrl.LocalConfig(lr=args.lr), seed=args.seed,
            loggers=args.logger)
        sft = trainer.sft(examples, epochs=args.sft_epochs, lr=args.sft_lr)
        result = trainer.fit()  # version 0 is the SFT policy: eval_before is its held-out success
    minutes = (time.time() - started) / 60
    print(f"\nheld-out success: base {base_success:.2f} -> after SFT {result.eval_before:.2f} -> after GRPO "
          f"{result.eval_after:.2f} ({args.steps} steps, {minutes:.1f} min)")
    print(json.dumps({
        "success_base": round(base_success, 3), "success_after_sft": round(result.eval_before, 3),
        "success_after_grpo": round(result.eval_after, 3), "sft_examples": len(examples),
        "collected_tries": len(collect), "collected_right": int(sum(collected)),
        "sft_loss_first_epoch": round(sft["sft_loss_first_epoch"], 4),
        "sft_loss_last_epoch": round(sft["sft_loss_last_epoch"], 4), "steps": args.steps, "seed": args.seed,
        "minutes": round(minutes, 2), "peak_rss_mb": peak_rss_mb(), "metrics": str(result.metrics_path),
        "store": str(out / "runs.db"),
    }))


if __name__ == "__main__":
    main()
