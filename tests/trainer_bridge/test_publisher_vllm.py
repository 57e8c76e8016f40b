"""The vLLM LoRA publisher against the real vLLM server: outputs change after a swap, spans record it."""

from __future__ import annotations

import openai
import pytest
import torch

import lightning_rl as lrl
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge import PublishError, VLLMLoRAPublisher, make_publisher

from ..conftest import ensure_tiny_model

pytestmark = pytest.mark.vllm
peft = pytest.importorskip("peft")

MESSAGES = [{"role": "user", "content": "What is 12+30?"}]


def _lora_model():
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()))
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(base, config)


def test_hot_swap_changes_outputs_and_policy_version(traced, vllm_url, tmp_path):
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY")
    model = _lora_model()
    publisher = make_publisher("vllm_lora", server_url=vllm_url, adapter_dir=tmp_path, served_name="policy")

    def next_token_logprobs(name):
        """The served model's log-probs for the first answer token: what the weights say, not a sample."""
        r = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1, temperature=0.0,
                                           logprobs=True, top_logprobs=5)
        return {t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs}

    @lrl.trace
    def agent(q):
        return next_token_logprobs("policy")

    try:
        publisher.publish(model, 0)  # a fresh LoRA (B = 0) is the base model
        before = agent("q")
        base = next_token_logprobs("tiny")
        assert before.keys() == base.keys()
        assert all(abs(before[k] - base[k]) < 1e-4 for k in base)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.5)
        publisher.publish(model, 1)
        after = agent("q")
        # the swap reached the server, in place, under the same name: the distribution moved
        shared = before.keys() & after.keys()
        assert before.keys() != after.keys() or max(abs(before[k] - after[k]) for k in shared) > 1e-2
        assert (tmp_path / "v00001" / "adapter_config.json").exists()
        versions = [t.llm_calls[0].policy_version for t in lrl.trajectories(traced)]
        assert versions == [0, 1]
    finally:
        tracing.versions.forget("policy")


def test_unreachable_server_is_a_clear_error(tmp_path):
    publisher = VLLMLoRAPublisher(server_url="http://127.0.0.1:9", adapter_dir=tmp_path)
    with pytest.raises(PublishError, match="cannot reach.*--enable-lora"):
        publisher.publish(_lora_model(), 0)


def test_unknown_publisher_lists_known():
    with pytest.raises(lrl.UnknownNameError, match="vllm_lora"):
        make_publisher("ftp")
