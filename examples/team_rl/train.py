#!/usr/bin/env python
"""The team demo: two agents, each with its own LoRA policy, improve from one shared reward (CPU).

A planner and a solver share the task "What is a+b?":

* the **planner** (served LoRA ``planner-lora``) is asked the question and hands the solver a plan: when
  it answers with a calculator call, which it does not run itself, the plan is the call's
  ``expression``; when it answers in words, its words are the plan (a guess, almost always wrong);
* the **solver** (served LoRA ``solver-lora``) is asked "What is <plan>?" and answers with its own
  calculator call's result (no call: no answer).

The team's reward is 1.0 for the exact sum, and it is the only signal: neither agent gets a reward of
its own (credit rule ``team``: every agent that took part receives the team reward). Both roles
matter and each has its own decision to learn: the planner to delegate (write the expression as a
call, not guess), the solver to compute (call its tool on the plan, not guess). The warm-started model
calls its tool in about 1 answer in 5, so the team starts near 0.05. Each agent has its own measure,
taken on its own input apart from the other, on the held-out tasks before and after training (8
samples a task at the training temperature): the planner's plans that evaluate to a+b, and the
solver's calls that compute a right plan ("What is a+b?" given to it). ``Trainer(policies=...)`` trains
both adapters of the one base model (PEFT multi-adapter) and hot-loads each into vLLM under its own
name. ``--shared`` runs the same team on one shared policy (both agents call ``team-lora``), same
budget and seeds.

Prints each training step's per-agent rates as it goes, held-out team success (greedy) before and
after, each agent's own measure, draws one curve per agent (``team.png``), and ends with one JSON line.

Run: make demo-team     (or .venv/bin/python examples/team_rl/train.py [--steps 40] [--shared] [--seed 0])
"""

from __future__ import annotations

import argparse
import asyncio
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

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from calculator_rl.train import CALCULATOR, make_tasks, peak_rss_mb  # noqa: E402
from word_problems import calculator  # noqa: E402

AGENTS = ("planner", "solver")


async def _ask(client: openai.AsyncOpenAI, model: str, question: str, temperature: float,
               seed: int) -> tuple[Any, str, str]:
    """One agent's turn: its calculator call (or None), the call's expression ("" without one), its text."""
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": question}]
    r = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                             temperature=temperature, max_tokens=64, seed=seed)
    message = r.choices[0].message
    if not message.tool_calls:
        return None, "", (message.content or "").strip()
    call = message.tool_calls[0]
    try:
        expression = str(json.loads(call.function.arguments).get("expression", ""))
    except (ValueError, AttributeError):
        expression = ""
    return call, expression, message.content or ""


async def _plan(client: openai.AsyncOpenAI, model: str, question: str, temperature: float, seed: int) -> str:
    """The planner's plan: the expression of the calculator call it writes, else its words."""
    call, expression, text = await _ask(client, model, question, temperature, seed)
    return expression if call is not None else text


def make_team(client: openai.AsyncOpenAI, names: dict[str, str], temperature: float, log: list[dict],
              per_step: int = 0):
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
            call, expression, _ = await _ask(client, names["solver"], f"What is {plan}?", temperature, seed + 1)
            answer = ""
            if call is not None:
                with lrl.tool_span("calculator", call_id=call.id, arguments=call.function.arguments) as tool:
                    tool.result = answer = calculator(expression)
        log.append({"mode": state.mode, "planner": calculator(plan) == target,
                    "solver": call is not None and answer == calculator(plan) and not answer.startswith("error"),
                    "team": answer == target})
        train = [r for r in log if r["mode"] == "train"]
        if state.mode == "train" and per_step and len(train) % per_step == 0:  # a step's rollouts are all in
            last = train[-per_step:]
            print(f"step {len(train) // per_step}: " + ", ".join(f"{k} {_rate(last, k):.2f}" for k in (*AGENTS, "team")),
                  flush=True)
        return 1.0 if answer == target else 0.0

    return team


async def agent_measures(base_url: str, names: dict[str, str], tasks: list[dict], temperature: float,
                         tries: int) -> dict[str, float]:
    """Each agent's own measure, on its own input, apart from the other: the planner's plans that evaluate to
    a+b, and the solver's calculator calls that compute a right plan ("What is a+b?"), each sampled ``tries``
    times per held-out task at the training temperature (same tasks and seeds before and after). Not traced:
    these calls are a measurement, not rollouts."""
    limit = asyncio.Semaphore(16)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY")  # of this event loop

    async def planner(task: dict, k: int) -> bool:
        async with limit:
            plan = await _plan(client, names["planner"], f"What is {task['a']}+{task['b']}?", temperature,
                               zlib.crc32(json.dumps(["planner", task, k]).encode()))
        return calculator(plan) == str(task["a"] + task["b"])

    async def solver(task: dict, k: int) -> bool:
        async with limit:
            call, expression, _ = await _ask(client, names["solver"], f"What is {task['a']}+{task['b']}?",
                                             temperature, zlib.crc32(json.dumps(["solver", task, k]).encode()))
        return call is not None and calculator(expression) == str(task["a"] + task["b"])

    out = {}
    for agent, measure in (("planner", planner), ("solver", solver)):
        hits = await asyncio.gather(*(measure(t, k) for t in tasks for k in range(tries)))
        out[agent] = round(sum(hits) / len(hits), 3)
    await client.close()
    return out


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
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--n", type=int, default=8, help="tries per task (GRPO group size)")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--eval-tasks", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of each policy (or the shared one)")
    parser.add_argument("--kl-coef", type=float, default=0.1,
                        help="KL to the base model in each policy's loss: where the team reward says nothing about a "
                             "token (every try of a group writes it), AdamW still moves it, and without this pull "
                             "back the planner of seed 1 drifted to plans without '+' that the solver learned to split")
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="sampling temperature of training rollouts (the trainer's log-probs use it too)")
    parser.add_argument("--measure-tries", type=int, default=8,
                        help="samples per held-out task of each agent's own measure, before and after")
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
        server = stack.enter_context(lrl.VLLMServer(model=args.model_dir, enable_lora=True, max_loras=2,
                                                log_path=out / "vllm.log"))
        store = lrl.configure(store=f"sqlite:///{out / 'runs.db'}")
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        # before: the base model, which is every policy's version 0 (a LoRA starts with B = 0)
        base = {a: server.served_name for a in AGENTS}
        measured_before = asyncio.run(agent_measures(server.base_url, base, held_out, args.temperature, args.measure_tries))
        trainer = lrl.Trainer(
            agent=make_team(client, names, args.temperature, log, args.n * args.tasks_per_step), tasks=train_tasks, store=store,
            model_dir=args.model_dir, server_url=server.url, out_dir=out, n=args.n,
            tasks_per_step=args.tasks_per_step, steps=args.steps,
            eval_tasks=held_out, eval_n=1, eval_agent=make_team(client, names, 0.0, log), policies=names,
            credit="team", seed=args.seed,
            local=lrl.LocalConfig(lr=args.lr, temperature=args.temperature, kl_coef=args.kl_coef),
        )
        result = trainer.fit()
        measured_after = asyncio.run(agent_measures(server.base_url, names, held_out, args.temperature, args.measure_tries))
    minutes = (time.time() - started) / 60
    evals = [r for r in log if r["mode"] == "eval"]
    before, after = evals[:len(held_out)], evals[len(held_out):]
    train = [r for r in log if r["mode"] == "train"]
    per_step = args.n * args.tasks_per_step
    curves = [{"step": i + 1, **{k: _rate(train[i * per_step:(i + 1) * per_step], k) for k in (*AGENTS, "team")}}
              for i in range(len(train) // per_step)]
    plot = plot_agents(curves, out / "team.png")
    first, last = train[:2 * per_step], train[-2 * per_step:]  # two steps of fresh tasks each, sampled
    agents = {a: {"before": measured_before[a], "after": measured_after[a],
                  "train_first_steps": _rate(first, a), "train_last_steps": _rate(last, a),
                  "greedy_before": _rate(before, a), "greedy_after": _rate(after, a)} for a in AGENTS}
    print(f"\nheld-out team success: {result.eval_before:.2f} before -> {result.eval_after:.2f} after {args.steps} "
          f"steps ({minutes:.1f} min, {'one shared policy' if args.shared else 'a policy per agent'})")
    print(f"each agent's own measure on the held-out tasks ({args.measure_tries} samples each at T="
          f"{args.temperature}, its own input), then in the team: first -> last two training steps (sampled), "
          f"held-out team runs (greedy):")
    for a in AGENTS:
        m = agents[a]
        print(f"  {a}: {m['before']:.2f} -> {m['after']:.2f}   in training {m['train_first_steps']:.2f} -> "
              f"{m['train_last_steps']:.2f}   greedy {m['greedy_before']:.2f} -> {m['greedy_after']:.2f}")
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
