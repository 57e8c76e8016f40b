"""The coding-fix family for ``bench_overlap.py --task coding`` (issue 56): the demo's agent, tasks, sandboxes and
score, with a stated latency on every ``run_tests``.

Each ``run_tests`` waits a log-normal time (``--tool-median``, clipped to [``--tool-min``, ``--tool-max``]) inside its
tool span before the task's tests run in the try's sandbox, drawn from the task, the try and the policy version, so
both loops see the same waits for the same sampled behaviour. This stands for a real repository's test run (seconds);
the tests here take under a second in their sandbox (0.38 s median, 0.77 s p90 measured on 2026-11-29 with the
trainer beside them), and their real durations are printed beside after each run.
Held-out success of a version: its adapter answers the held-out tasks (sampled, the same seeds for every version)
with no wait, each try in its sandbox, scored by the task's tests."""

from __future__ import annotations

import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "coding_fix"))

import lightning_rl as lrl  # noqa: E402
from lightning_rl.sandbox.pool import PoolPerTask  # noqa: E402
from lightning_rl.trainer_bridge.runner import Runner  # noqa: E402

import tasks as family  # noqa: E402
import tools  # noqa: E402
from agent import make_agent  # noqa: E402
from traces import READABLE_KINDS  # noqa: E402

TRAIN_SEED_START = 200_000  # past the warm start's tasks and the demo's
TEMPERATURE = 0.5  # the demo's: sampling, evaluation and the trainer's log-probs
LOCAL = {"temperature": TEMPERATURE, "mini_batch_size": 32}  # lr 3e-4 (CODING_DEFAULTS), no KL: as §27 measured it


class Family:
    """One seed's task sets, their folders and their sandbox pools."""

    def __init__(self, seed: int, eval_tasks: int, out: Path, difficulty: int = 0, train_tasks: int = 120) -> None:
        def drawn(split: str, count: int, start: int) -> list[family.Task]:
            made = [family.generate(start + i, split=split, difficulty=difficulty,
                                    kind=READABLE_KINDS[i % len(READABLE_KINDS)]) for i in range(count)]
            for task in made:
                family.verify(task)
            return made

        self.held_out_tasks = drawn("heldout", eval_tasks, 0)
        self.train_tasks = drawn("train", train_tasks, TRAIN_SEED_START + 1000 * seed)
        self.by_id = {t.task_id: t for t in self.held_out_tasks + self.train_tasks}
        self.folders = out / "tasks"
        self.pools = PoolPerTask(self._folder_of, size=8, max_pools=48)

    def _folder_of(self, task: dict) -> tuple[str, Path]:
        target = self.folders / task["id"]
        if not target.exists():
            self.by_id[task["id"]].write(target)
        return task["id"], target

    @staticmethod
    def as_task(task: family.Task) -> dict:
        return {"id": task.task_id, "prompt": task.prompt}

    @property
    def held_out(self) -> list[dict]:
        return [self.as_task(t) for t in self.held_out_tasks]

    @property
    def tasks(self) -> list[dict]:
        return [self.as_task(t) for t in self.train_tasks]

    def trainer_options(self) -> dict[str, Any]:
        return {"sandboxes": self.pools, "score": tools.score, "protect": list(family.Task.protected),
                "rollout_timeout": 600.0}

    def close(self) -> None:
        self.pools.close()


def agent(client: Any, model: str, temperature: float, delay: Any = None, *, seeded_by_version: bool = True):
    return make_agent(client, model, temperature, seeded_by_version=seeded_by_version, run_tests_delay=delay)


def evaluate(fam: Family, server_url: str, model: str, concurrency: int, eval_n: int = 2) -> float:
    """Mean held-out score of what ``model`` serves now (sampled, seeds fixed across versions; no wait)."""
    import openai

    store = lrl.configure(store="memory://")
    client = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="EMPTY", max_retries=0)  # bound to the runner's loop
    aio = asyncio.Runner()  # the runner's loop, closed here after the client: one collected later complained
    try:
        groups = [store.enqueue(t, n=eval_n, mode="eval")[0].group_id for t in fam.held_out]
        with Runner(store, agent(client, model, TEMPERATURE, seeded_by_version=False), concurrency=concurrency,
                    sandboxes=fam.pools, score=tools.score, protect=list(family.Task.protected), loop=aio) as runner:
            runner.run_until_done(groups)
        aio.run(client.close())
        rewards = []
        for entry in store.queue_entries(groups):
            got = store.rewards(entry.rollout_id) if entry.outcome == "succeeded" else []
            rewards.append(got[0].value if got else 0.0)
        return sum(rewards) / len(rewards)
    finally:
        aio.close()
        store.close()


def real_run_tests_seconds() -> dict[str, float | int]:
    seconds = tools.RUN_TESTS_SECONDS
    if not seconds:
        return {"count": 0}
    return {"count": len(seconds), "median_s": round(statistics.median(seconds), 3),
            "p90_s": round(sorted(seconds)[int(0.9 * (len(seconds) - 1))], 3)}
