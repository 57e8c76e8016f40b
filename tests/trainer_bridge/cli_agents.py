"""A module-level traced agent that ``lightning-rl train run --agent`` imports by name."""

import os

import openai

import lightning_rl as lrl

BASE_URL = "TEST_AGENT_BASE_URL"  # the served model's OpenAI base URL (.../v1), set by the test
MODEL = "TEST_AGENT_MODEL"  # the served name it calls (default: policy, the LoRA)


@lrl.trace
async def add(task):
    client = openai.AsyncOpenAI(base_url=os.environ[BASE_URL], api_key="EMPTY")
    r = await client.chat.completions.create(model=os.environ.get(MODEL, "policy"), max_tokens=6, temperature=1.0,
                                             messages=[{"role": "user", "content": f"What is {task['a']}+{task['b']}?"}])
    return 1.0 if (r.choices[0].message.content or "").strip() == str(task["a"] + task["b"]) else 0.0
