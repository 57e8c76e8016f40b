#!/usr/bin/env python
"""The team demo: two agents, each with its own LoRA policy, improve from one shared reward (CPU).

A planner and a solver share the task "What is a+b?":

* the **planner** (served LoRA ``planner-lora``) writes the expression to compute, as a calculator
  call it does not run itself (its reply is prefilled with ``<tool_call>``): its plan is the call's
  ``expression``;
* the **solver** (served LoRA ``solver-lora``) is asked "What is <plan>?" and answers with its own
  calculator call's result.

The team's reward is 1.0 for the exact sum, and it is the only signal: neither agent gets a reward of
its own (credit rule ``team``: every agent that took part receives the team reward). Both roles
matter: a wrong plan or a wrong copy of it fails the task. Each agent has its own measure: the
planner's plans that evaluate to a+b, the solver's calculator calls that compute the plan it was
given. ``Trainer(policies=...)`` trains both adapters of the one base model (PEFT multi-adapter) and
hot-loads each into vLLM under its own name. ``--shared`` runs the same team on one shared policy
(both agents call ``team-lora``), same budget and seeds.

Prints held-out team success (greedy) before and after, each agent's measure on the first and last
two training steps (tasks those steps had not seen, sampled at the training temperature) and on the
held-out tasks, draws one curve per agent (``team.png``), and ends with one JSON line.

Run: make demo-team     (or .venv/bin/python examples/team_rl/train.py --steps 20 [--shared])
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import openai

import lightning_rl as lrl
from lightning_rl.tracer import current_rollout, tracing
from lightning_rl.trainer_bridge.local import LocalConfig
from lightning_rl.trainer_bridge.trainer import Trainer
from lightning_rl.vllm_server import VLLMServer

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from calculator_rl.train import CALCULATOR, make_tasks, peak_rss_mb  # noqa: E402
from word_problems import calculator  # noqa: E402

AGENTS = ("planner", "solver")


async def _plan(client: openai.AsyncOpenAI, model: str, question: str, temperature: float, seed: int) -> str:
    """The planner's plan: the expression of the calculator call it writes ("" if it writes no valid call).

    Its reply is prefilled with ``<tool_call>`` (vLLM's ``continue_final_message``), so it always writes a
    call, in the format the model was warm-started on, with no guided decoding: ``tool_choice="required"``
    samples under a grammar mask, whose log-probs the trainer cannot reproduce, and a format the model
    never saw."""
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": question},
                {"role": "assistant", "content": "<tool_call>"}]
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    r = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                             temperature=temperature, max_tokens=64, seed=seed, extra_body=prefill)
    text = r.choices[0].message.content or ""
    try:
        return str(json.loads(text.split("</tool_call>")[0])["arguments"]["expression"])
    except (ValueError, KeyError, TypeError):
        return ""


async def _solve(client: openai.AsyncOpenAI, model: str, question: str, temperature: float,
                 seed: int) -> tuple[Any, str]:
    """The solver's calculator call and its expression, or None and "" when it answers without the tool."""
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": question}]
    r = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                             temperature=temperature, max_tokens=64, seed=seed)
    message = r.choices[0].message
    if not message.tool_calls:
        return None, ""
    call = message.tool_calls[0]
    try:
        expression = str(json.loads(call.function.arguments).get("expression", ""))
    except (ValueError, AttributeError):
        expression = ""
    return call, expression


def make_team(client: openai.AsyncOpenAI, names: dict[str, str], temperature: float, log: list[dict]):
    @lrl.trace(agent="team")
    async def team(task: dict) -> float:
        state = current_rollout()
        # Reproducible sampling: the seed depends on the task, the attempt and the planner's version.
        seed = zlib.crc32(json.dumps([task, state.attempt, tracing.policy_version(names["planner"])]).encode())
        seed &= 0x7FFFFFFF
        target = str(task["a"] + task["b"])
        with lrl.agent_scope("planner"):
            plan = await _plan(client, names["planner"], f"What is {task['a']}+{task['b']}?", temperature, seed)
        with lrl.agent_scope("solver"):
            call, expression = await _solve(client, names["solver"], f"What is {plan}?", temperature, seed + 1)
            answer = ""
            if call is not None:
                with lrl.tool_span("calculator", call_id=call.id, arguments=call.function.arguments) as tool:
                    tool.result = answer = calculator(expression)
        log.append({"mode": state.mode, "planner": calculator(plan) == target,
                    "solver": call is not None and answer == calculator(plan) and not answer.startswith("error"),
                    "team": answer == target})
        return 1.0 if answer == target else 0.0

    return team


def _rate(rows: list[dict], key: str) -> float:
    return round(sum(r[key] for r in rows) / max(1, len(rows)), 3)


def plot_agents(curves: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    steps = [c["step"] for c in curves]
    for key, label in (("planner", "planner: plans that evaluate to a+b"),
                       ("solver", "solver: calls that compute its plan"), ("team", "team success (the reward)")):
        ax.plot(steps, [c[key] for c in curves], marker="o", linestyle="--" if key == "team" else "-", label=label)
    ax.set_xlabel("train step (rollouts of that step)")
    ax.set_ylabel("rate")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="a two-agent team trained from a shared reward (CPU)")
    parser.add_argument("--shared", action="store_true", help="one policy for both agents (the baseline)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--n", type=int, default=8, help="tries per task (GRPO group size)")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--eval-tasks", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3, help="the solver's learning rate (the shared policy's)")
    parser.add_argument("--planner-lr", type=float, default=1e-4,
                        help="the planner's (per-agent policies only): its reward signal is mostly noise until "
                             "the solver calls its tool")
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="sampling temperature of training rollouts (the trainer's log-probs use it too); at "
                             "1.0 the tiny model's team succeeds in about 3 tries of 100, too few to learn from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-qwen2"))
    parser.add_argument("--out", default=None, help="default: .cache/demo-team (or demo-team-shared)")
    args = parser.parse_args()
    started = time.time()
    out = Path(args.out or ROOT / ".cache" / ("demo-team-shared" if args.shared else "demo-team"))
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    if not (Path(args.model_dir) / "config.json").exists():
        subprocess.run(["make", "-C", str(ROOT), "model"], check=True)

    names = {a: "team-lora" for a in AGENTS} if args.shared else {a: f"{a}-lora" for a in AGENTS}
    held_out = make_tasks(args.eval_tasks, seed=10_000 + args.seed)
    train_tasks = make_tasks(400, seed=args.seed, exclude={(t["a"], t["b"]) for t in held_out})
    log: list[dict] = []
    with contextlib.ExitStack() as stack:
        print(f"serving {args.model_dir} with vLLM (CPU, {len(set(names.values()))} LoRA policies) ...", flush=True)
        server = stack.enter_context(VLLMServer(model=args.model_dir, enable_lora=True, max_loras=2,
                                                log_path=out / "vllm.log"))
        store = lrl.configure(store=f"sqlite:///{out / 'runs.db'}")
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        trainer = Trainer(
            agent=make_team(client, names, args.temperature, log), tasks=train_tasks, store=store,
            model_dir=args.model_dir, server_url=server.url, out_dir=out, n=args.n,
            tasks_per_step=args.tasks_per_step, steps=args.steps,
            eval_tasks=held_out, eval_n=1, eval_agent=make_team(client, names, 0.0, log), policies=names,
            credit="team", seed=args.seed,
            local=LocalConfig(lr=args.lr, temperature=args.temperature,
                              policy_lr={} if args.shared else {names["planner"]: args.planner_lr}),
        )
        result = trainer.fit()
    minutes = (time.time() - started) / 60
    evals = [r for r in log if r["mode"] == "eval"]
    before, after = evals[:len(held_out)], evals[len(held_out):]
    train = [r for r in log if r["mode"] == "train"]
    per_step = args.n * args.tasks_per_step
    curves = [{"step": i + 1, **{k: _rate(train[i * per_step:(i + 1) * per_step], k) for k in (*AGENTS, "team")}}
              for i in range(len(train) // per_step)]
    plot = plot_agents(curves, out / "team.png")
    first, last = train[:2 * per_step], train[-2 * per_step:]  # two steps of fresh tasks each, sampled
    agents = {a: {"before": _rate(first, a), "after": _rate(last, a), "held_out_before": _rate(before, a),
                  "held_out_after": _rate(after, a)} for a in AGENTS}
    print(f"\nheld-out team success: {result.eval_before:.2f} before -> {result.eval_after:.2f} after {args.steps} "
          f"steps ({minutes:.1f} min, {'one shared policy' if args.shared else 'a policy per agent'})")
    print("each agent's measure, first -> last two training steps (sampled), and held-out (greedy):")
    for a in AGENTS:
        m = agents[a]
        print(f"  {a}: {m['before']:.2f} -> {m['after']:.2f}   held-out {m['held_out_before']:.2f} -> "
              f"{m['held_out_after']:.2f}")
    print(f"per-agent curves: {plot}; reward plot: {result.plot_path}; metrics: {result.metrics_path}")
    print(json.dumps({
        "policies": "shared" if args.shared else "per_agent",
        "team_success_before": round(result.eval_before, 3), "team_success_after": round(result.eval_after, 3),
        "gain": round(result.eval_after - result.eval_before, 3), "agents": agents, "steps": args.steps,
        "seed": args.seed, "minutes": round(minutes, 2), "peak_rss_mb": peak_rss_mb(), "plot": str(plot),
        "metrics": str(result.metrics_path), "store": str(out / "runs.db"),
    }))


if __name__ == "__main__":
    main()
