#!/usr/bin/env python
"""The main demo: an agent gets better at its job from rewards, on 2 CPU cores, end to end.

1. The tiny model (``make model``: Qwen2 architecture, warm-started on synthetic calculator
   conversations, so it knows the tool-call format but mostly guesses) is served by vLLM (CPU)
   with LoRA hot-loading.
2. A calculator agent (plain openai client, ``@lrl.trace``) answers "What is a+b?". It either
   answers directly (a guess, almost always wrong) or calls its calculator tool and answers with
   the tool's result, which is right only if it copied the expression correctly. Reward 1.0 for
   the exact sum.
3. ``Trainer.fit``: tasks are queued n times (GRPO groups), runners execute the agent against the
   served LoRA ``policy``, the local trainer (PEFT LoRA, verl's GRPO + PPO-clip math) updates on
   the succeeded rollouts, and each new adapter is hot-loaded into vLLM in place.
4. Held-out success before and after, the reward plot, and one JSON line.

Run: make demo     (or .venv/bin/python examples/calculator_rl/train.py --steps 12)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai

import lightning_rl as lrl
from lightning_rl.tracer import current_rollout, tracing

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from word_problems import calculator  # noqa: E402

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def make_tasks(n: int, seed: int, exclude: set[tuple[int, int]] = frozenset()) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a, b) not in exclude:
            out.append({"a": a, "b": b})
    return out


async def answer(client: openai.AsyncOpenAI, model: str, task: dict, temperature: float, seed: int | None = None,
                 tool_wait: Callable[[], Awaitable[None]] | None = None) -> str:
    """The calculator agent's answer to "What is a+b?": its words, or its calculator call's result.
    ``tool_wait()``, when given, is awaited inside the calculator call (a slow tool)."""
    messages = [{"role": "system", "content": "Be exact."},
                {"role": "user", "content": f"What is {task['a']}+{task['b']}?"}]
    first = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                                 temperature=temperature, max_tokens=64,
                                                 **({"seed": seed} if seed is not None else {}))
    message = first.choices[0].message
    if not message.tool_calls:
        return message.content or ""
    call = message.tool_calls[0]
    try:
        expression = str(json.loads(call.function.arguments).get("expression", ""))
    except (ValueError, AttributeError):
        expression = ""
    with lrl.tool_span("calculator", call_id=call.id, arguments=call.function.arguments) as tool:
        if tool_wait is not None:
            await tool_wait()
        tool.result = calculator(expression)
    return tool.result  # the agent answers with its tool's result


def make_agent(client: openai.AsyncOpenAI, model: str, temperature: float,
               tool_wait: Callable[[dict, int, int], Awaitable[None]] | None = None):
    """The calculator agent, rewarded 1.0 for the exact sum. ``tool_wait(task, attempt, version)``, when
    given, is awaited inside each calculator call (a slow tool, for the overlap benchmark)."""

    @lrl.trace(agent="calculator")
    async def calculator_agent(task: dict) -> float:
        state = current_rollout()
        version = tracing.policy_version(model)
        # Reproducible sampling: the seed depends on the task, the attempt and the policy version.
        seed = zlib.crc32(json.dumps([task, state.attempt, version]).encode()) & 0x7FFFFFFF
        wait = None if tool_wait is None else (lambda: tool_wait(task, state.attempt, version))
        said = await answer(client, model, task, temperature, seed, wait)
        return 1.0 if said.strip() == str(task["a"] + task["b"]) else 0.0

    return calculator_agent


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the vLLM server, once stopped
    return round(max(own, children) / 1024, 1)


def add_training_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """The calculator demos' training settings (this demo's and the gateway demo's)."""
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--n", type=int, default=8, help="tries per task (GRPO group size)")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--eval-tasks", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--logger", action="append", default=[], metavar="NAME",
                        help="also log to tensorboard, mlflow or wandb (offline); repeat for several")
    add_run_arguments(parser, out)


def add_run_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """Seed, model and output folder (``.cache/<out>``), as every demo takes them."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-qwen2"))
    parser.add_argument("--out", default=str(ROOT / ".cache" / out))


def demo_tasks(eval_tasks: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The held-out sums and the 400 training sums (never a held-out one), as every calculator demo uses them."""
    held_out = make_tasks(eval_tasks, seed=10_000 + seed)
    return held_out, make_tasks(400, seed=seed, exclude={(t["a"], t["b"]) for t in held_out})


def serve_with_lora(stack: contextlib.ExitStack, model_dir: str | Path, out: Path) -> lrl.VLLMServer:
    """vLLM serving the demo model with LoRA hot-loading, for the length of ``stack``."""
    print(f"serving {model_dir} with vLLM (CPU, LoRA hot-loading) ...", flush=True)
    return stack.enter_context(lrl.VLLMServer(model=str(model_dir), enable_lora=True, max_lora_rank=16,
                                          log_path=out / "vllm.log"))


def fresh_run(out: str | Path, model_dir: str | Path, target: str = "model") -> Path:
    """An empty output folder, and the demo model built (``make model``, or ``target``) if it is not there yet."""
    out = Path(out)
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    if not (Path(model_dir) / "config.json").exists():
        subprocess.run(["make", "-C", str(ROOT), target], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="calculator agent RL demo (CPU)")
    add_training_arguments(parser, "demo-rl")
    parser.add_argument("--server-url", default=None,
                        help="A running vLLM server with --enable-lora serving --model-dir (default: start one).")
    args = parser.parse_args()
    started = time.time()
    out = fresh_run(args.out, args.model_dir)

    held_out, train_tasks = demo_tasks(args.eval_tasks, args.seed)
    with contextlib.ExitStack() as stack:
        if args.server_url:
            server_url = args.server_url.rstrip("/").removesuffix("/v1")
        else:
            server_url = serve_with_lora(stack, args.model_dir, out).url
        store = lrl.configure(store=f"sqlite:///{out / 'runs.db'}")
        client = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="EMPTY")
        trainer = lrl.Trainer(
            agent=make_agent(client, "policy", temperature=1.0), tasks=train_tasks, store=store,
            model_dir=args.model_dir, server_url=server_url, out_dir=out, n=args.n,
            tasks_per_step=args.tasks_per_step, steps=args.steps, eval_tasks=held_out, eval_n=1,
            eval_agent=make_agent(client, "policy", temperature=0.0),
            local=lrl.LocalConfig(lr=args.lr), seed=args.seed, loggers=args.logger,
        )
        result = trainer.fit()
    minutes = (time.time() - started) / 60
    print(f"\nheld-out success: {result.eval_before:.2f} before -> {result.eval_after:.2f} after "
          f"{args.steps} steps ({minutes:.1f} min); reward plot: {result.plot_path}; metrics: {result.metrics_path}")
    print(json.dumps({
        "success_before": round(result.eval_before, 3), "success_after": round(result.eval_after, 3),
        "gain": round(result.eval_after - result.eval_before, 3), "steps": args.steps, "seed": args.seed,
        "minutes": round(minutes, 2), "peak_rss_mb": peak_rss_mb(), "plot": str(result.plot_path),
        "metrics": str(result.metrics_path), "store": str(out / "runs.db"),
    }))


if __name__ == "__main__":
    main()
