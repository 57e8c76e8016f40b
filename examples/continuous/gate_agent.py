"""The continuous demo's gate agent: the production calculator agent on held-out sums, with the true reward.

``lightning-rl train continuous --gate-agent examples.continuous.gate_agent:solve`` runs it on the
``--gate-tasks`` file, once against the candidate adapter and once against the live one: the gate sets
the model to call (``lrl.current_endpoint()``), and the rollout's mode (eval: never trained on).
Production users' feedback can be wrong (the simulator's bad phase rewards wrong answers); this reward
is the sum's truth, so a candidate that learned the users' mistake scores lower here and is refused.
It samples as production does (temperature 0.7), with a seed per task: the candidate and the live
policy answer each sum with the same draw of randomness.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import openai

import lightning_rl as lrl

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "examples" / "calculator_rl"))
sys.path.insert(0, str(ROOT / "examples"))
from train import answer  # noqa: E402  (the main demo's agent)

#: production's sampling temperature (simulate.py passes its --temperature)
TEMPERATURE = float(os.environ.get("DEMO_GATE_TEMPERATURE", "0.7"))
_clients: dict[str, openai.AsyncOpenAI] = {}


@lrl.trace(agent="calculator", task="task")
async def solve(task: dict) -> float:
    base_url, model = lrl.current_endpoint()
    client = _clients.get(base_url)
    if client is None:
        client = _clients[base_url] = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0,
                                                         timeout=120)
    seed = zlib.crc32(f"{task['a']}+{task['b']}".encode()) & 0x7FFFFFFF
    said = await answer(client, model, task, TEMPERATURE, seed)
    return 1.0 if said.strip() == str(task["a"] + task["b"]) else 0.0
