#!/usr/bin/env python
"""A LangChain tool-calling agent that answers questions over a real SQLite database (shop.db).

The agent (``langchain.agents.create_agent``, named ``sql_agent``) has one tool, ``run_sql``,
which runs a read-only query on shop.db. Reward: 1.0 when the rows of its last successful query
equal the rows of the question's gold query (order-insensitive), else 0.0. lightning-rl needs no
change to the agent: ``@lrl.trace`` on the entry function records every LLM call (agent name,
engine token ids) and every tool call (span with its call id).

Run:  .venv/bin/python examples/langchain_sql/agent.py [--tasks 10]
      LIGHTNING_RL_BASE_URL=http://host:8000/v1 LIGHTNING_RL_MODEL=Qwen/Qwen2.5-Coder-1.5B-Instruct \\
          .venv/bin/python examples/langchain_sql/agent.py
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from summary import summarize  # noqa: E402

import lightning_rl as lrl  # noqa: E402
from lightning_rl.vllm_server import serve_or_connect  # noqa: E402

DB = HERE / "shop.db"
SCHEMA = ("Tables: customers(id, name, city); products(id, name, price); "
          "orders(id, customer_id, product_id, quantity, order_date 'YYYY-MM-DD').")


def query(sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{DB}?mode=ro", uri=True) as db:  # read-only: the agent cannot change it
        return db.execute(sql).fetchall()


def load_questions(n: int) -> list[dict]:
    rows = [json.loads(line) for line in (HERE / "questions.jsonl").read_text().splitlines() if line.strip()]
    return rows[:n]


def same_rows(a: list, b: list) -> bool:
    return sorted(map(repr, map(tuple, a))) == sorted(map(repr, map(tuple, b)))


def build(base_url: str, model: str, api_key: str):
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_tokens=160, temperature=1.0)

    @lrl.trace(agent="sql_agent")
    def answer(task: dict) -> float:
        results: list[list] = []  # rows of every successful query, in order

        @tool
        def run_sql(sql: str) -> str:
            """Run a read-only SQLite query on the shop database and return its rows as JSON."""
            try:
                rows = query(sql)
            except sqlite3.Error as exc:
                return f"error: {exc}"
            results.append(rows)
            return json.dumps(rows)

        agent = create_agent(llm, tools=[run_sql], name="sql_agent",
                             system_prompt=f"Answer questions about a shop database. {SCHEMA} Use run_sql.")
        try:
            agent.invoke({"messages": [{"role": "user", "content": task["question"]}]}, {"recursion_limit": 8})
        except Exception as exc:  # e.g. the recursion limit: the rollout still gets its reward
            print(f"  agent stopped: {type(exc).__name__}")
        return 1.0 if results and same_rows(results[-1], query(task["gold_sql"])) else 0.0

    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description="LangChain SQL agent over shop.db")
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--store", default="sqlite:///.cache/examples/langchain_sql.db")
    args = parser.parse_args()
    Path(".cache/examples").mkdir(parents=True, exist_ok=True)
    store = lrl.configure(store=args.store)
    with serve_or_connect() as (base_url, model, api_key):
        answer = build(base_url, model, api_key)
        rollout_ids = []
        for task in load_questions(args.tasks):
            reward = answer(task)
            rollout_ids.append(store.rollouts(newest_first=True, limit=1)[0].rollout_id)
            print(f"{task['question']}  reward={reward}")
    print(json.dumps(summarize(store, rollout_ids, train_agent="sql_agent")))


if __name__ == "__main__":
    main()
