#!/usr/bin/env python
"""A solver + checker team in plain Python with the bare openai client, traced with lightning-rl.

The solver may call a calculator tool; the checker restates the final number; the team shares
one reward (1.0 when the checker's number is right). ``agent_scope`` names each agent's LLM calls
and ``tool_span`` records the tool call. At the end it prints per-agent training samples: "train
only the solver" is ``agents=["solver"]``.

Run:  .venv/bin/python examples/openai_plain/agent.py [--tasks 6]
      LIGHTNING_RL_BASE_URL=http://host:8000/v1 LIGHTNING_RL_MODEL=Qwen/Qwen2.5-1.5B-Instruct .venv/bin/python examples/openai_plain/agent.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from summary import summarize  # noqa: E402
from word_problems import calculator, is_correct, problems  # noqa: E402

import lightning_rl as lrl  # noqa: E402
from lightning_rl.vllm_server import serve_or_connect  # noqa: E402

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def build(client: openai.OpenAI, model: str):
    def ask(messages, **kw):
        return client.chat.completions.create(model=model, messages=messages, temperature=1.0, **kw).choices[0].message

    @lrl.trace(agent="team")
    def solve(problem: dict) -> float:
        messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": problem["question"]}]
        with lrl.agent_scope("solver"):
            message = ask(messages, tools=[CALCULATOR], max_tokens=120)
            if message.tool_calls:
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls:
                    with lrl.tool_span("calculator", call_id=call.id, arguments=call.function.arguments) as tool:
                        try:
                            expression = json.loads(call.function.arguments).get("expression", "")
                        except (ValueError, AttributeError):
                            expression = ""
                        tool.result = calculator(str(expression))
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": tool.result})
                message = ask(messages, max_tokens=40)
            proposed = message.content or ""
        with lrl.agent_scope("checker"):
            verdict = ask([{"role": "system", "content": "Answer with the number."},
                           {"role": "user", "content": f"{problem['question']} Proposed: {proposed}"}], max_tokens=20)
        return 1.0 if is_correct(verdict.content, problem["answer"]) or is_correct(proposed, problem["answer"]) else 0.0

    return solve


def main() -> None:
    parser = argparse.ArgumentParser(description="plain-openai solver + checker team")
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--store", default="sqlite:///.cache/examples/openai_plain.db")
    args = parser.parse_args()
    Path(".cache/examples").mkdir(parents=True, exist_ok=True)
    store = lrl.configure(store=args.store)
    with serve_or_connect() as (base_url, model, api_key):
        solve = build(openai.OpenAI(base_url=base_url, api_key=api_key), model)
        rollout_ids = []
        for problem in problems(args.tasks):
            with lrl.rollout_overrides(group_id=f"word-{problem['id']}"):
                reward = solve(problem)
            rollout_ids.append(store.rollouts(newest_first=True, limit=1)[0].rollout_id)
            print(f"{problem['question']}  gold={problem['answer']}  reward={reward}")
    print(json.dumps(summarize(store, rollout_ids)))


if __name__ == "__main__":
    main()
