#!/usr/bin/env python
"""An AutoGen team (solver with a calculator tool + checker) on arithmetic word problems.

Nothing in the team is changed for lightning-rl: ``@lrl.trace`` on the entry function is all.
Each LLM call carries the participant's name and the engine's token ids; tool executions are
spans with their call ids. The team shares one reward (1.0 when the last message has the right
number). At the end: samples for "train only the solver" and for "train all agents".

Run:  .venv/bin/python examples/autogen_team/team.py [--tasks 4]
      LIGHTNING_RL_BASE_URL=http://host:8000/v1 LIGHTNING_RL_MODEL=... .venv/bin/python examples/autogen_team/team.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_ext.models.openai import OpenAIChatCompletionClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from summary import summarize  # noqa: E402
from word_problems import calculator, is_correct, problems  # noqa: E402

import lightning_rl as lrl  # noqa: E402
from lightning_rl.vllm_server import serve_or_connect  # noqa: E402

MODEL_INFO = {"vision": False, "function_calling": True, "json_output": True, "family": "unknown",
              "structured_output": True}


def make_team(base_url: str, model: str, api_key: str) -> RoundRobinGroupChat:
    def client() -> OpenAIChatCompletionClient:
        return OpenAIChatCompletionClient(model=model, base_url=base_url, api_key=api_key, model_info=MODEL_INFO,
                                          max_tokens=120, temperature=1.0)

    solver = AssistantAgent("solver", model_client=client(), tools=[calculator], system_message="Be exact.",
                            reflect_on_tool_use=True)
    checker = AssistantAgent("checker", model_client=client(), system_message="Answer with the number.")
    return RoundRobinGroupChat([solver, checker], termination_condition=MaxMessageTermination(3))


async def run(args: argparse.Namespace) -> None:
    store = lrl.configure(store=args.store)
    with serve_or_connect() as (base_url, model, api_key):

        @lrl.trace(agent="team")
        async def solve(problem: dict) -> float:
            result = await make_team(base_url, model, api_key).run(task=problem["question"])
            last = result.messages[-1]
            text = last.content if isinstance(last.content, str) else str(last.content)
            return 1.0 if is_correct(text, problem["answer"]) else 0.0

        rollout_ids = []
        for problem in problems(args.tasks, seed=1):
            reward = await solve(problem)
            rollout_ids.append(store.rollouts(newest_first=True, limit=1)[0].rollout_id)
            print(f"{problem['question']}  gold={problem['answer']}  reward={reward}")
    print(json.dumps(summarize(store, rollout_ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description="AutoGen solver + checker team")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--store", default="sqlite:///.cache/examples/autogen_team.db")
    args = parser.parse_args()
    Path(".cache/examples").mkdir(parents=True, exist_ok=True)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
