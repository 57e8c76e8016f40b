"""export-model --merge: the merged model, served by vLLM as it is, answers as base + adapter does."""

from __future__ import annotations

import json
import urllib.request

import pytest
from click.testing import CliRunner

from lightning_rl.cli import main
from lightning_rl.vllm_server import VLLMServer

from ..conftest import TEST_KV_CACHE_MIB, ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "What is 12+7? The answer is"


def _greedy(server: VLLMServer, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "seed": 0, "return_token_ids": True}
    request = urllib.request.Request(server.base_url + "/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def test_the_merged_model_gives_the_greedy_answer_of_base_plus_adapter(tmp_path):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_rl.trainer_bridge.config import TARGET_MODULES

    base_dir = ensure_tiny_model()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES), init_lora_weights=False)
    adapter = tmp_path / "adapter"
    peft.get_peft_model(model, lora).save_pretrained(str(adapter))  # a LoRA whose B is not zero: it changes answers

    merged = tmp_path / "merged"
    result = CliRunner().invoke(main, ["export-model", "--adapter", str(adapter), "--merge", "--out", str(merged),
                                       "--base-model", str(base_dir)])
    assert result.exit_code == 0, result.output
    assert (merged / "config.json").is_file() and (merged / "lightning_rl_export.json").is_file()
    assert not (merged / "adapter_config.json").exists()

    with VLLMServer(model=str(base_dir), enable_lora=True, kv_cache_mib=TEST_KV_CACHE_MIB, log_path=tmp_path / "base.log") as server:
        base_answer = _greedy(server, server.served_name)
        request = urllib.request.Request(server.url + "/v1/load_lora_adapter", data=json.dumps(
            {"lora_name": "adapter", "lora_path": str(adapter)}).encode(), headers={"content-type": "application/json"})
        urllib.request.urlopen(request, timeout=120).read()
        adapter_answer = _greedy(server, "adapter")
    assert adapter_answer != base_answer  # the adapter matters, so the comparison below can fail
    with VLLMServer(model=str(merged), kv_cache_mib=TEST_KV_CACHE_MIB, log_path=tmp_path / "merged.log") as server:
        assert _greedy(server, server.served_name) == adapter_answer


def test_bad_export_model_input_is_named(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["export-model", "--adapter", str(tmp_path), "--merge", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "not a LoRA adapter folder" in result.output
    result = runner.invoke(main, ["export-model", "--adapter", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "add --merge" in result.output
