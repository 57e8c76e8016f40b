#!/usr/bin/env python
"""Continuous training from production traffic: simulated users, real vLLM, the real CLI trainer.

1. vLLM (CPU) serves the tiny model with LoRA hot-loading.
2. ``lightning-rl train continuous`` runs as a subprocess: it publishes version 0 of the LoRA
   ``policy``, then trains from rewarded production rollouts as they arrive and hot-loads each new
   version. Nothing else trains the served model.
3. Simulated users ask the calculator agent "What is a+b?" at Poisson times. The agent (the main
   demo's, with its tool and questions imported: plain AsyncOpenAI client, a calculator tool;
   sampled at temperature 0.7, and the trainer computes its log-probs at the same temperature) is
   traced with ``mode="prod"`` and returns its answer, never a reward: production does not know
   whether it is right.
   A fraction of users give feedback (``store.add_reward``: 1.0 right, 0.0 wrong) after a random
   delay (exponential, capped); the others never do.
4. Phases counted in the trainer's candidates, not minutes (``Phases``): after ``--learn-updates``
   candidates a bad phase lasts ``--bad-updates`` more; traffic ends ``--after-updates`` later (or at
   ``--max-minutes``). The users who arrive in the bad phase give wrong feedback: they reward a
   confident wrong answer and not a right one (``--bad-kind inverted``), or give a coin flip (``noise``),
   and every one of them gives it (``--bad-feedback 1.0``: a broken feedback button that answers for every
   user), so the trainer's batches in the phase are wrong feedback alone. The trainer cannot tell; it
   trains on it.
5. The guard: each update is a candidate, evaluated by the gate before it goes live: the production
   agent (``gate_agent.py``) on held-out sums (``--gate-tasks`` of them, never asked in production),
   with the true reward, against the candidate and against the live policy; promoted only when not
   worse (one-sided Welch test, ``--gate-margin`` at ``--gate-confidence``), else refused and kept on
   disk, and training goes on from the live policy. ``--gate-tasks 0`` runs without the gate.
6. The simulator knows every right answer, so it measures the true production success rate in
   windows of time, for all users, including those who never give feedback.

Output: ``production.png`` (success per window, each published version and each refusal marked, the
bad phase shaded) and a last stdout line of JSON (``gate_refused``; ``refused_worse``: the refusals of a
candidate that scored below the live policy by more than the gate's margin, the guard catching what the
bad phase taught, not a candidate merely unproven; ``rolled_back``; ``max_drop``: the largest fall of
success from one window to the next).

Run: make demo-continuous   (or .venv/bin/python examples/continuous/simulate.py --seed 1)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import openai

import lightning_rl as lrl

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "examples" / "calculator_rl"))
sys.path.insert(0, str(ROOT / "examples"))
from train import add_run_arguments, answer, fresh_run, make_tasks  # noqa: E402  (the main demo's agent, questions, run folder)


SERVED = "policy"


@dataclass
class Answer:
    rollout_id: str
    arrived: float  # seconds since traffic started
    finished: float
    correct: bool
    feedback_delay: float | None  # None: this user never gives feedback
    bad: bool = False  # arrived in the bad phase: the feedback is wrong
    failed: bool = False  # the request failed: a wrong answer, and no feedback
    feedback_given: bool = False


def make_production_agent(client: openai.AsyncOpenAI, temperature: float):
    @lrl.trace(agent="calculator", mode="prod", task="task")
    async def calculator_agent(task: dict) -> str:
        # the main demo's agent; an answer, not a reward: production does not know if it is right
        return await answer(client, SERVED, task, temperature)

    return calculator_agent


def trainer_command(args: argparse.Namespace, store_url: str, server_url: str, out: Path,
                    gate_path: Path | None) -> list[str]:
    temperature = [] if args.temperature == 1.0 else ["--temperature", str(args.temperature)]
    gate = [] if gate_path is None else [
        "--gate-tasks", str(gate_path), "--gate-agent", "examples.continuous.gate_agent:solve",
        "--gate-margin", str(args.gate_margin), "--gate-confidence", str(args.gate_confidence)]
    return [*shlex.split(args.cli), "train", "continuous",
            "--store", store_url, "--model-dir", args.model_dir, "--server-url", server_url,
            "--served-name", SERVED, "--out", str(out / "trainer"), "--min-new", str(args.min_new),
            "--max-policy-lag", str(args.max_policy_lag), "--reward-name", args.reward_name,
            "--lr", str(args.lr), "--interval", str(args.interval), *temperature, *gate]


def feedback_value(answer: Answer, kind: str, rng: random.Random) -> float:
    """What the user says: 1.0 for a right answer, 0.0 for a wrong one, unless they arrived in the bad
    phase: then ``inverted`` rewards the wrong answer and not the right one, ``noise`` flips a coin."""
    if not answer.bad:
        return 1.0 if answer.correct else 0.0
    if kind == "inverted":
        return 0.0 if answer.correct else 1.0
    return float(rng.random() < 0.5)


def check_cli(args: argparse.Namespace) -> None:
    """The trainer must compute log-probs at the agents' temperature: fail now if the CLI cannot be told."""
    if args.temperature == 1.0:
        return
    text = subprocess.run([*shlex.split(args.cli), "train", "continuous", "--help"], capture_output=True, text=True).stdout
    if "--temperature" not in text:
        raise SystemExit(f"`{args.cli} train continuous` has no --temperature option; production samples at "
                         f"{args.temperature}, and the trainer must compute log-probs at it (or run --temperature 1.0)")


def wait_for_version0(store, trainer: subprocess.Popen, timeout: float = 600.0) -> float:
    """Wait until the trainer has published version 0 (the LoRA is served); returns the time."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if trainer.poll() is not None:
            raise SystemExit(f"the trainer exited with {trainer.returncode} before publishing version 0")
        published = store.policies(SERVED)
        if published:
            return published[0].time
        time.sleep(0.5)
    raise SystemExit(f"the trainer published nothing in {timeout:.0f}s")


class Phases:
    """Where traffic stands, counted in the trainer's candidates (its ``metrics.jsonl`` lines: every update
    trained, promoted or refused), not in minutes: a slower machine makes fewer updates a minute, and a phase
    measured in minutes then taught less before the bad phase and held too few candidates trained on wrong
    feedback (a loaded machine made 3 updates in 6 minutes). ``learn`` until ``--learn-updates`` candidates,
    ``bad`` (the wrong feedback) for ``--bad-updates`` more, then ``after`` for ``--after-updates`` more and at
    least two windows, so that the last minute measured is past the bad phase; traffic ends then, or at
    ``--max-minutes`` (``capped``)."""

    def __init__(self, args: argparse.Namespace, metrics: Path, t0: float) -> None:
        self.args, self.metrics, self.t0 = args, metrics, t0
        self.name = "learn"
        self.bad_from: float | None = None  # seconds of traffic
        self.bad_until: float | None = None
        self.capped = False

    def candidates(self) -> int:
        try:
            return self.metrics.read_text().count("\n")
        except FileNotFoundError:
            return 0

    def update(self, now: float) -> bool:
        """Move on as the trainer's candidates say; False once traffic must end."""
        at, done, a = now - self.t0, self.candidates(), self.args
        if self.name == "learn" and done >= a.learn_updates:
            self.name, self.bad_from = "bad", at
        if self.name == "bad" and done >= a.learn_updates + a.bad_updates:
            self.name, self.bad_until = "after", at
        if at >= a.max_minutes * 60:
            self.capped = True
            return False
        return not (self.name == "after" and done >= a.learn_updates + a.bad_updates + a.after_updates
                    and at >= self.bad_until + 2 * a.window)

    @property
    def bad(self) -> bool:
        return self.name == "bad"


async def traffic(agent, store, args: argparse.Namespace, rng: random.Random, t0: float,
                  held_out: set[tuple[int, int]], phases: Phases) -> list[Answer]:
    """Questions at Poisson times (never a held-out one) until ``phases`` ends traffic; feedback after its
    delay while traffic lasts."""
    tasks = make_tasks(100_000, seed=args.seed, exclude=held_out)
    answers: list[Answer] = []
    in_flight = asyncio.Semaphore(args.concurrency)
    running: set[asyncio.Task] = set()

    async def feedback(answer: Answer) -> None:
        await asyncio.sleep(max(0.0, t0 + answer.finished + answer.feedback_delay - time.time()))
        await asyncio.to_thread(store.add_reward, answer.rollout_id, feedback_value(answer, args.bad_kind, rng),
                                name=args.reward_name, uid=f"feedback-{answer.rollout_id}")
        answer.feedback_given = True

    async def user(task: dict, arrived: float, delay: float | None, bad: bool) -> None:
        rollout_id = uuid.uuid4().hex
        async with in_flight:
            with lrl.rollout_overrides(rollout_id=rollout_id):
                try:
                    text = await agent(task)
                except Exception as exc:  # a failed request is a wrong answer for that user
                    print(f"request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    text = None
        answer = Answer(rollout_id, arrived, time.time() - t0,
                        text is not None and text.strip() == str(task["a"] + task["b"]), delay,
                        bad=bad, failed=text is None)
        answers.append(answer)
        if delay is not None and not answer.failed:
            await feedback(answer)

    i = 0
    next_at = t0
    while True:
        next_at += rng.expovariate(args.rate)
        while time.time() < next_at:  # the phase is checked while waiting for the next user
            if not phases.update(time.time()):
                break
            await asyncio.sleep(min(0.5, max(0.0, next_at - time.time())))
        if not phases.update(max(time.time(), next_at)):
            break
        gives = rng.random() < (args.bad_feedback if phases.bad else args.feedback)
        delay = min(rng.expovariate(1 / args.feedback_delay), args.feedback_max) if gives else None
        task = asyncio.create_task(user(tasks[i], next_at - t0, delay, phases.bad))
        running.add(task)
        task.add_done_callback(running.discard)
        i += 1
    # Traffic is over: requests still running are not counted, feedback still to come is never given.
    pending = [t for t in running if not t.done()]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return answers


def windows(answers: list[Answer], width: float, minutes: float) -> list[dict]:
    out = []
    n = max(1, int(round(minutes * 60 / width)))
    for k in range(n):
        inside = [a for a in answers if k * width <= a.arrived < (k + 1) * width]
        out.append({"start": k * width, "end": (k + 1) * width, "n": len(inside),
                    "success": sum(a.correct for a in inside) / len(inside) if inside else None})
    return out


def max_drop(wins: list[dict]) -> float:
    """The largest fall of success from one window to the next (0.0 when it never falls)."""
    rates = [w["success"] for w in wins if w["success"] is not None]
    return max([0.0, *(a - b for a, b in zip(rates, rates[1:]))])


def rate(answers: list[Answer]) -> float | None:
    return sum(a.correct for a in answers) / len(answers) if answers else None


def plot(path: Path, wins: list[dict], publishes: list[tuple[int, float]], refused: list[tuple[int, float]],
         bad: tuple[float, float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.9), dpi=110)
    xs = [(w["start"] + w["end"]) / 120 for w in wins if w["success"] is not None]
    ys = [w["success"] for w in wins if w["success"] is not None]
    if bad[1] > bad[0]:
        ax.axvspan(bad[0], bad[1], color="tab:red", alpha=0.08, label="bad phase: users' feedback is wrong")
    ax.plot(xs, ys, marker="o", label="production success (all users, per window)")
    for k, (version, at) in enumerate(refused):
        ax.plot([at / 60], [0.0], marker="x", color="tab:red", linestyle="none",
                label="candidate refused by the gate" if k == 0 else None)
    for k, (version, at) in enumerate(publishes):
        if version == 0:
            continue
        ax.axvline(at / 60, color="tab:gray", alpha=0.45, linestyle=":",
                   label="new policy version published" if k == 1 else None)
        ax.annotate(f"v{version}", (at / 60, 1.02), fontsize=6, ha="center", color="tab:gray")
    ax.set_xlabel("minutes of traffic")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.05, 1.08)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def stop(process: subprocess.Popen, timeout: float = 30.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="continuous training from simulated production traffic (CPU)")
    parser.add_argument("--learn-updates", type=int, default=6,
                        help="candidates the trainer makes before the bad phase (Phases)")
    parser.add_argument("--bad-updates", type=int, default=4,
                        help="candidates it makes while the bad phase lasts (0: no bad phase)")
    parser.add_argument("--after-updates", type=int, default=4,
                        help="candidates it makes after the bad phase, before traffic ends")
    parser.add_argument("--max-minutes", type=float, default=30.0,
                        help="traffic ends then whatever the phase (the summary says capped)")
    parser.add_argument("--rate", type=float, default=5.0, help="questions per second (Poisson)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--feedback", type=float, default=0.7, help="fraction of users who give feedback")
    parser.add_argument("--feedback-delay", type=float, default=20.0, help="mean feedback delay, seconds")
    parser.add_argument("--feedback-max", type=float, default=180.0, help="longest feedback delay, seconds")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="production sampling temperature (the trainer computes log-probs at it)")
    parser.add_argument("--min-new", type=int, default=64, help="fresh rewarded rollouts per update")
    parser.add_argument("--max-policy-lag", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between the trainer's checks")
    parser.add_argument("--reward-name", default="user_feedback")
    parser.add_argument("--cli", default=f"{shlex.quote(sys.executable)} -m lightning_rl.cli",
                        help="the lightning-rl command the trainer runs with")
    parser.add_argument("--trainer-threads", type=int, default=1,
                        help="torch threads of the trainer (OMP_NUM_THREADS): it shares the cores with vLLM")
    parser.add_argument("--window", type=float, default=30.0, help="seconds per success window")
    parser.add_argument("--bad-feedback", type=float, default=1.0,
                        help="fraction of the bad phase's users who give (wrong) feedback")
    parser.add_argument("--bad-kind", choices=["inverted", "noise"], default="inverted",
                        help="inverted: users reward wrong answers, not right ones; noise: a coin flip")
    parser.add_argument("--gate-tasks", type=int, default=64, help="held-out sums the gate asks (0: no gate)")
    parser.add_argument("--gate-margin", type=float, default=0.1)
    parser.add_argument("--gate-confidence", type=float, default=0.9)
    add_run_arguments(parser, "demo-continuous")
    args = parser.parse_args()
    for name in ("learn_updates", "bad_updates", "after_updates"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} is a count of candidates, got {getattr(args, name)}")
    started = time.time()
    out = fresh_run(args.out, args.model_dir)
    check_cli(args)
    rng = random.Random(args.seed)
    store_url = f"sqlite:///{out / 'runs.db'}"
    gate_tasks = make_tasks(args.gate_tasks, seed=10_000 + args.seed)
    held_out = {(t["a"], t["b"]) for t in gate_tasks}
    gate_path = None
    if gate_tasks:
        gate_path = out / "gate_tasks.jsonl"
        gate_path.write_text("".join(json.dumps(t) + "\n" for t in gate_tasks))

    with contextlib.ExitStack() as stack:
        print(f"serving {args.model_dir} with vLLM (CPU, LoRA hot-loading) ...", flush=True)
        server = stack.enter_context(lrl.VLLMServer(model=args.model_dir, enable_lora=True, max_lora_rank=16,
                                                log_path=out / "vllm.log"))
        store = lrl.configure(store=store_url)
        command = trainer_command(args, store_url, server.url, out, gate_path)
        print("trainer:", " ".join(command), flush=True)
        log = stack.enter_context(open(out / "trainer.log", "w"))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.trainer_threads),
               "DEMO_GATE_TEMPERATURE": str(args.temperature)}
        trainer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env)
        stack.callback(stop, trainer)
        wait_for_version0(store, trainer)
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=120)
        agent = make_production_agent(client, args.temperature)
        t0 = time.time()
        print(f"traffic: {args.rate}/s, {args.feedback:.0%} of users give feedback after ~{args.feedback_delay:.0f}s "
              f"(at most {args.feedback_max:.0f}s); the bad phase after {args.learn_updates} candidates, for "
              f"{args.bad_updates}; traffic ends {args.after_updates} candidates later (at most "
              f"{args.max_minutes:g} min)", flush=True)
        phases = Phases(args, out / "trainer" / "metrics.jsonl", t0)
        answers = asyncio.run(traffic(agent, store, args, rng, t0, held_out, phases))
        traffic_seconds = time.time() - t0
        stop(trainer)
        store.flush()

    publishes = [(p.version, p.time - t0) for p in store.policies(SERVED)]  # what the trainer recorded
    decisions = store.decisions(SERVED)
    refused = [(d.version, d.time - t0) for d in decisions if d.decision == "refused"]
    metrics_path = out / "trainer" / "metrics.jsonl"
    updates = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    first_update = next((at for v, at in publishes if v >= 1), None)
    width = args.window
    wins = windows(answers, width, traffic_seconds / 60)
    before_end = min(first_update if first_update is not None else traffic_seconds, 2 * width)
    before = [a for a in answers if a.arrived < before_end]
    after = [a for a in answers if a.arrived >= traffic_seconds - 2 * width]
    bad_from = phases.bad_from if phases.bad_from is not None else traffic_seconds
    bad_until = phases.bad_until if phases.bad_until is not None else traffic_seconds
    by_version: dict[int, list[bool]] = {}
    served = {r.rollout_id: r.policy_version for r in store.rollouts(mode="prod")}
    for a in answers:
        by_version.setdefault(served.get(a.rollout_id) or 0, []).append(a.correct)
    success_before, success_after = rate(before), rate(after)
    plot_path = out / "production.png"
    guard = (f"gate: {args.gate_tasks} held-out sums, margin {args.gate_margin:g}" if gate_path else "no gate")
    plot(plot_path, wins, publishes, refused, (bad_from / 60, bad_until / 60),
         f"calculator agent in production (temperature {args.temperature:g}), seed {args.seed}; {guard}\n"
         f"{args.rate:g} questions/s, {args.feedback:.0%} give feedback; trainer: min_new {args.min_new}, "
         f"lr {args.lr:g}, max_policy_lag {args.max_policy_lag}")
    with (out / "windows.jsonl").open("w") as f:
        for w in wins:
            f.write(json.dumps(w) + "\n")
    minutes = (time.time() - started) / 60
    summary = {
        "success_before": None if success_before is None else round(success_before, 3),
        "success_after": None if success_after is None else round(success_after, 3),
        "gain": None if None in (success_before, success_after) else round(success_after - success_before, 3),
        "success_by_version": {v: round(sum(c) / len(c), 3) for v, c in sorted(by_version.items())},
        "rollouts_by_version": {v: len(c) for v, c in sorted(by_version.items())},
        "window_success": [None if w["success"] is None else round(w["success"], 3) for w in wins],
        "max_drop": round(max_drop(wins), 3),
        "gate_refused": len(refused),
        "refused_worse": sum(u.get("gate_decision") == "refused" and u["gate_difference"] < -u["gate_margin"]
                             for u in updates),
        "gate_promoted": sum(d.decision == "promoted" for d in decisions),
        "rolled_back": sum(d.decision == "rolled_back" for d in decisions),
        "bad_phase": [round(bad_from / 60, 2), round(bad_until / 60, 2), args.bad_kind],  # minutes of traffic
        "phases": {"learn_updates": args.learn_updates, "bad_updates": args.bad_updates,
                   "after_updates": args.after_updates},
        "capped": phases.capped,  # traffic ended at --max-minutes, before the phases had their candidates
        "bad_feedback": sum(a.bad and a.feedback_given for a in answers),
        "first_update_at_min": None if first_update is None else round(first_update / 60, 2),
        "traffic_minutes": round(traffic_seconds / 60, 2),
        "minutes": round(minutes, 2),
        "updates": len(updates),  # candidates trained (with the gate: promoted or refused)
        "rollouts": len(answers),
        "rewards_given": sum(a.feedback_given for a in answers),
        "feedback_never": sum(a.feedback_delay is None for a in answers),
        "feedback_too_late": sum(a.feedback_delay is not None and not a.feedback_given and not a.failed
                                 for a in answers),
        "requests_failed": sum(a.failed for a in answers),
        "trained_on": sum(u["rollouts"] for u in updates),
        "dropped_stale": sum(u["dropped_stale"] for u in updates),  # counted by the updates they preceded
        "gate_tasks": args.gate_tasks, "gate_margin": args.gate_margin, "gate_confidence": args.gate_confidence,
        "rate": args.rate, "feedback": args.feedback, "bad_feedback_share": args.bad_feedback, "min_new": args.min_new, "lr": args.lr,
        "max_policy_lag": args.max_policy_lag, "seed": args.seed, "model_dir": args.model_dir,
        "plot": str(plot_path), "metrics": str(metrics_path),
        "store": str(out / "runs.db"), "trainer_log": str(out / "trainer.log"),
    }
    print(f"\nproduction success: {summary['success_before']} before the first update -> "
          f"{summary['success_after']} in the last {2 * width:.0f}s; {len(updates)} updates, "
          f"{summary['gate_refused']} refused by the gate; largest fall between windows {summary['max_drop']}; "
          f"{minutes:.1f} min; plot: {plot_path}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
