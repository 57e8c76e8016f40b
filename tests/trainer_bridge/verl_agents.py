"""A traced agent for the verl agent-loop test: it calls whatever endpoint the loop chose."""

import openai

import lightning_rl as lrl


@lrl.trace(agent="solver")
async def two_turn_solver(task):
    base_url, model = lrl.current_endpoint()
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY")
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "tool says 42"}]
    final = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0)
    return 1.0 if "42" in (final.choices[0].message.content or "") else 0.25
