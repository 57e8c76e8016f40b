#!/usr/bin/env python
"""The main demo, with the agent in Node.js: the calculator task trained through the gateway (CPU).

``calculator.mjs`` is the main demo's calculator agent (``examples/calculator_rl``) written with the
official ``openai`` npm package and no lightning-rl code. ``lrl.command`` runs it once per rollout with
its ``OPENAI_BASE_URL`` pointing at that rollout through an in-process gateway, so its calls are
recorded with the engine's token ids, and reads its reward from its last line of output. ``Trainer``
does the rest exactly as in the main demo: GRPO groups, LoRA updates, hot-loads into vLLM, held-out
success (greedy) before and after.

Run: make demo-gateway     (or .venv/bin/python examples/gateway_node/train.py [--steps 20] [--seed 0])
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import lightning_rl as lrl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from calculator_rl.train import add_training_arguments, demo_tasks, fresh_run, peak_rss_mb, serve_with_lora  # noqa: E402


def node_agent(server_url: str, temperature: float):
    return lrl.command(["node", str(HERE / "calculator.mjs")], upstream=server_url, name="calculator.mjs",
                       agent="calculator", env={"AGENT_MODEL": "policy", "AGENT_TEMPERATURE": str(temperature)})


def main() -> None:
    parser = argparse.ArgumentParser(description="the calculator demo with a Node.js agent, through the gateway")
    add_training_arguments(parser, "demo-gateway")
    args = parser.parse_args()
    if shutil.which("node") is None or not (HERE / "node_modules" / "openai").is_dir():
        sys.exit("this demo needs Node.js and the openai npm package: run `make node-deps`")
    started = time.time()
    out = fresh_run(args.out, args.model_dir)
    held_out, train_tasks = demo_tasks(args.eval_tasks, args.seed)
    with contextlib.ExitStack() as stack:
        server = serve_with_lora(stack, args.model_dir, out)
        store = lrl.configure(store=f"sqlite:///{out / 'runs.db'}")
        trainer = lrl.Trainer(
            agent=node_agent(server.url, 1.0), tasks=train_tasks, store=store, model_dir=args.model_dir,
            server_url=server.url, out_dir=out, n=args.n, tasks_per_step=args.tasks_per_step, steps=args.steps,
            eval_tasks=held_out, eval_n=1, eval_agent=node_agent(server.url, 0.0), local=lrl.LocalConfig(lr=args.lr),
            seed=args.seed, loggers=args.logger)
        result = trainer.fit()
        calls = [c for t in lrl.trajectories(store, mode="train") for c in t.llm_calls]
    minutes = (time.time() - started) / 60
    engine_ids = sum(c.token_ids_source == "engine" for c in calls)
    print(f"\nheld-out success of the Node.js agent: {result.eval_before:.2f} before -> {result.eval_after:.2f} after "
          f"{args.steps} steps ({minutes:.1f} min); {engine_ids}/{len(calls)} training calls recorded with the "
          f"engine's token ids; reward plot: {result.plot_path}")
    print(json.dumps({
        "success_before": round(result.eval_before, 3), "success_after": round(result.eval_after, 3),
        "gain": round(result.eval_after - result.eval_before, 3), "steps": args.steps, "seed": args.seed,
        "minutes": round(minutes, 2), "peak_rss_mb": peak_rss_mb(), "calls": len(calls),
        "calls_with_engine_ids": engine_ids, "plot": str(result.plot_path), "metrics": str(result.metrics_path),
        "store": str(out / "runs.db"),
    }))


if __name__ == "__main__":
    main()
