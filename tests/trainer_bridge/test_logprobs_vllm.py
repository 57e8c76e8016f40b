"""The engine's log-probs and the trainer's mean the same thing: on the same weights in float32 they
agree token by token, at the temperature the tokens were sampled with (real vLLM, real model)."""

from __future__ import annotations

import openai
import pytest

import lightning_rl as lrl

from ..conftest import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("peft")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_engine_and_trainer_logprobs_agree_on_the_same_weights(traced, vllm_url, temperature):
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend, build_batch

    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace
    def agent(q):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=24,
                                       temperature=temperature, seed=11, extra_body={"ignore_eos": True})
        return 1.0

    for q in ("What is 12+30?", "Be exact: 7+8?", "hello"):
        agent(q)
    samples, _ = lrl.samples(traced)
    assert len(samples) == 3 and all(len(s.response_ids) == 24 for s in samples)
    # a fresh adapter (B = 0) on the served base weights, float32 as vLLM serves them here
    backend = LocalBackend(ensure_tiny_model(), LocalConfig(temperature=temperature), device="cpu")
    batch = build_batch(samples, backend.pad_token_id)
    trainer = backend.response_logprobs(batch, list(range(len(samples)))).detach()
    gap = (trainer - batch.engine_logprobs).abs()
    print(f"\nT={temperature}: max |engine - trainer| {gap.max().item():.2e}, mean {gap.mean().item():.2e}")
    assert gap.max().item() < 2e-3, gap.max().item()
    assert gap.mean().item() < 2e-4, gap.mean().item()
    # and it is not a coincidence: at another temperature the trainer's numbers no longer match
    other = LocalBackend(ensure_tiny_model(), LocalConfig(temperature=temperature + 0.3), device="cpu")
    assert (other.response_logprobs(batch, list(range(len(samples)))).detach()
            - batch.engine_logprobs).abs().mean().item() > 10 * max(gap.mean().item(), 1e-4)
