"""A traced agent for the verl agent-loop test: it calls whatever endpoint the loop chose.

Its answers are digits by guided decoding, so each prompt extends the previous prompt + answer as an
exact token prefix on any model (the test asserts no prefix split).
"""

import openai

import lightning_rl as lrl


@lrl.trace(agent="solver")
async def two_turn_solver(task):
    base_url, model = lrl.current_endpoint()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY") as client:  # closed in this loop
        messages = [{"role": "user", "content": task["question"]}]
        digits = {"structured_outputs": {"regex": "[0-9]{1,6}"}}
        first = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0,
                                                     extra_body=digits)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "tool says 42"}]
        final = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0,
                                                     extra_body=digits)
        return 1.0 if "42" in (final.choices[0].message.content or "") else 0.25


@lrl.trace(agent="solver")
async def resetting_solver(task):
    """Two calls whose token prefix breaks: the second re-renders the conversation with a system message in
    front (as an agent that compacts or re-templates its context does), so each call is a segment of its own."""
    base_url, model = lrl.current_endpoint()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY") as client:  # closed in this loop
        digits = {"structured_outputs": {"regex": "[0-9]{1,6}"}}
        messages = [{"role": "user", "content": task["question"]}]
        first = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, extra_body=digits)
        messages = [{"role": "system", "content": "Be brief."}, *messages,
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "tool says 42"}]
        final = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, extra_body=digits)
        return 1.0 if "42" in (final.choices[0].message.content or "") else 0.25


async def _two_free_segments(task) -> str:
    """Two calls without guided decoding whose token prefix breaks (a system message put in front): the text
    the model wrote."""
    base_url, model = lrl.current_endpoint()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY") as client:  # closed in this loop
        messages = [{"role": "user", "content": task["question"]}]
        first = await client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        messages = [{"role": "system", "content": "Be brief."}, *messages,
                    {"role": "assistant", "content": first.choices[0].message.content or ""},
                    {"role": "user", "content": "Answer with a number."}]
        final = await client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        return (first.choices[0].message.content or "") + (final.choices[0].message.content or "")


_TRIES: dict[str, int] = {}


def _turn(task) -> int:
    """0 and 1 by turns over the tries of ``task`` in this process (verl's one agent-loop worker here)."""
    _TRIES[task["question"]] = _TRIES.get(task["question"], 0) + 1
    return _TRIES[task["question"]] % 2


@lrl.trace(agent="solver")
async def free_resetting_solver(task):
    """``resetting_solver`` without guided decoding (the engine's log-probs are then the actor's distribution:
    a grammar-masked sample's are not), rewarded by what it wrote (the share of digits in its answers) plus 0.01 on
    every other try of a task, so that with an even ``rollout.n`` the tries of a group never tie: a group whose
    tries tie has no advantage, and a step of such groups no gradient, whatever the model is (seen with the seed-7
    tiny model: a step of grad norm 0). Two segments per try, whatever the model writes."""
    text = await _two_free_segments(task)
    return sum(ch.isdigit() for ch in text) / max(len(text), 1) + 0.01 * _turn(task)


@lrl.trace(agent="solver")
async def alternating_solver(task):
    """``free_resetting_solver``'s two segments, rewarded 1.0 and 0.0 by turns per task, whatever the model writes:
    every update has a gradient of the same size (``make test-verl-e2e``'s float32 run checks that the served
    weights follow the actor's: an update that vanished because the model wrote the same thing every try would
    show nothing)."""
    await _two_free_segments(task)
    return float(_turn(task))
