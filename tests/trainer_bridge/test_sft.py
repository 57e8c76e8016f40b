"""Trainer.sft: a LoRA warm-started from exported conversations, which fit() then starts from."""

from __future__ import annotations

import json

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.trainer_bridge.local import LocalBackend, LocalConfig, build_batch, load_adapter
from lightning_rl.trainer_bridge.sft import sft_samples
from lightning_rl.trainer_bridge.trainer import Trainer

from ..conftest import ensure_tiny_model

pytest.importorskip("peft")
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def _examples(n: int = 12) -> list[dict]:
    out = []
    for i in range(n):
        a, b = 3 + i, 11 + 2 * i
        out.append({"messages": [{"role": "system", "content": "Be exact."},
                                 {"role": "user", "content": f"What is {a}+{b}?"},
                                 {"role": "assistant", "content": f"The sum is {a + b}. Checked twice."}],
                    "tools": TOOLS, "reward": 1.0, "rollout_id": f"r{i}"})
    return out


def _mean_logprob(backend: LocalBackend, samples) -> float:
    import torch

    batch = build_batch(samples, backend.pad_token_id)
    with torch.no_grad():
        lp = backend.response_logprobs(batch, slice(0, len(samples)), 1.0)
    return float((lp * batch.response_mask).sum() / batch.response_mask.sum())


def test_sft_lowers_the_loss_and_fit_starts_from_its_adapter(tmp_path):
    model = ensure_tiny_model()
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in _examples()))
    trainer = Trainer(agent=lambda task: 0.0, tasks=[1], store=None, model_dir=model, server_url="http://127.0.0.1:9",
                      out_dir=tmp_path / "run", local=LocalConfig(lr=5e-3, mini_batch_size=4, micro_batch_size=4))
    stats = trainer.sft(data, epochs=3)
    assert stats["sft_samples"] == 12 and stats["sft_optimizer_steps"] == 9
    assert stats["sft_loss_last_epoch"] < stats["sft_loss_first_epoch"]
    assert trainer.init_adapter == tmp_path / "run" / "sft_adapter"
    assert json.loads((tmp_path / "run" / "sft.json").read_text())["sft_samples"] == 12

    samples = sft_samples(_examples(), model)
    assert all(s.response_mask == [1] * len(s.response_ids) for s in samples)
    fresh = LocalBackend(model, LocalConfig())
    before = _mean_logprob(fresh, samples)
    load_adapter(fresh, trainer.init_adapter)  # what fit() does first
    after = _mean_logprob(fresh, samples)
    assert after > before + 0.05, (before, after)  # the warm-started policy prefers the demonstrated answers


def test_bad_sft_input_is_named(tmp_path):
    model = ensure_tiny_model()
    with pytest.raises(ConfigurationError, match="must end with the assistant's message"):
        sft_samples([{"messages": [{"role": "user", "content": "hi"}]}], model)
    with pytest.raises(ConfigurationError, match="is not a file"):
        sft_samples(tmp_path / "missing.jsonl", model)
    with pytest.raises(ConfigurationError, match="no SFT examples"):
        sft_samples([], model)
    with pytest.raises(ConfigurationError, match="not a LoRA adapter folder"):
        load_adapter(LocalBackend(model, LocalConfig()), tmp_path)


def test_the_sft_command_writes_an_adapter_from_exported_chat(tmp_path):
    from click.testing import CliRunner

    from lightning_rl.cli import main

    data = tmp_path / "good.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in _examples(4)))
    result = CliRunner().invoke(main, ["sft", "--data", str(data), "--model-dir", str(ensure_tiny_model()),
                                       "--out", str(tmp_path / "sft"), "--epochs", "1"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "sft" / "sft_adapter" / "adapter_config.json").is_file()
    (line,) = [x[x.index('{"sft'):] for x in result.output.splitlines() if '{"sft' in x]  # after progress bars
    assert json.loads(line)["sft_samples"] == 4
