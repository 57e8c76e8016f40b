"""The span payload both store servers are loaded with in bench_store_server.py (pure Python, no
lightning_rl import, so the peer's environment can use it too)."""

from __future__ import annotations

import random


def llm_attributes(prompt_tokens: int, response_tokens: int, seed: int) -> dict:
    """Attributes of one LLM call span as our tracer records it: token ids, log-probs, usage."""
    rng = random.Random(seed)
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "tiny-qwen2",
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": response_tokens,
        "gen_ai.response.finish_reasons": ["stop"],
        "lightning_rl.llm_call.index": seed % 8,
        "lightning_rl.token_ids.source": "engine",
        "lightning_rl.policy.version": 0,
        "lightning_rl.prompt_token_ids": [rng.randrange(32000) for _ in range(prompt_tokens)],
        "lightning_rl.response_token_ids": [rng.randrange(32000) for _ in range(response_tokens)],
        "lightning_rl.response_logprobs": [round(-rng.random() * 3, 6) for _ in range(response_tokens)],
    }
