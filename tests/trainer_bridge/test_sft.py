"""Trainer.sft: a LoRA warm-started from exported conversations, which fit() then starts from."""

from __future__ import annotations

import json

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.local import LocalBackend, build_batch, load_adapter
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
    assert trainer.start_adapter == tmp_path / "run" / "sft_adapter" and trainer.init_adapter is None  # kept apart
    assert json.loads((tmp_path / "run" / "sft.json").read_text())["sft_samples"] == 12

    samples = sft_samples(_examples(), model)
    assert all(s.response_mask == [1] * len(s.response_ids) for s in samples)
    fresh = LocalBackend(model, LocalConfig())
    before = _mean_logprob(fresh, samples)
    assert trainer._init_adapters() == {"policy": tmp_path / "run" / "sft_adapter"}  # what fit() loads first
    load_adapter(fresh, trainer.start_adapter)
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


def _team_examples() -> list[dict]:
    out = []
    for i in range(8):
        a, b = 3 + i, 11 + 2 * i
        ask = [{"role": "user", "content": f"What is {a}+{b}?"}]
        out.append({"messages": ask + [{"role": "assistant", "content": "Plan: add the two numbers, then check."}],
                    "agent": "planner", "rollout_id": f"r{i}"})
        out.append({"messages": ask + [{"role": "assistant", "content": f"Answer: {a + b}"}],
                    "agent": "solver", "rollout_id": f"r{i}"})
    out.append({"messages": [{"role": "user", "content": "Rate it."}, {"role": "assistant", "content": "Fine."}],
                "agent": "critic", "rollout_id": "r0"})  # an agent the team does not train
    return out


def test_team_sft_trains_each_policy_on_its_own_agents_examples(tmp_path):
    model = ensure_tiny_model()
    team = {"planner": "planner-lora", "solver": "solver-lora"}
    trainer = Trainer(agent=lambda task: 0.0, tasks=[1], store=None, model_dir=model, server_url="http://127.0.0.1:9",
                      out_dir=tmp_path / "run", policies=team,
                      local=LocalConfig(lr=5e-3, mini_batch_size=4, micro_batch_size=4))
    stats = trainer.sft(_team_examples(), epochs=3)
    assert stats["sft_skipped_no_policy"] == 1 and stats["sft_policies_without_data"] == []
    assert {name: s["sft_samples"] for name, s in stats["policies"].items()} == {"planner-lora": 8, "solver-lora": 8}
    for name in team.values():
        assert stats["policies"][name]["sft_loss_last_epoch"] < stats["policies"][name]["sft_loss_first_epoch"]

    # what fit() does first: each policy's adapter from sft_adapter/<served name>/
    folders = trainer._init_adapters()
    assert folders == {name: tmp_path / "run" / "sft_adapter" / name for name in team.values()}
    backend = LocalBackend(model, LocalConfig(), policies=list(team.values()))
    samples = sft_samples(_team_examples()[:-1], model)
    mine = {agent: [s for s in samples if s.agent_name == agent] for agent in team}

    def fit(policy: str, agent: str) -> float:
        backend._use(policy)
        return _mean_logprob(backend, mine[agent])

    fresh = {agent: fit("planner-lora", agent) for agent in team}
    for policy in team.values():
        load_adapter(backend, folders[policy], policy=policy)
    after = {(policy, agent): fit(policy, agent) for policy in team.values() for agent in team}
    for agent, policy in team.items():
        assert after[policy, agent] > fresh[agent] + 0.05, (after, fresh)  # each policy learned its agent's answers
        other = next(p for p in team.values() if p != policy)
        assert after[policy, agent] > after[other, agent] + 0.75, after  # far more than the other policy did


def test_team_sft_refuses_data_that_reaches_no_policy_and_adapters_of_no_policy(tmp_path):
    model = ensure_tiny_model()
    common = dict(agent=lambda task: 0.0, tasks=[1], store=None, model_dir=model, server_url="http://127.0.0.1:9",
                  out_dir=tmp_path / "run")
    trainer = Trainer(**common, policies={"planner": "p", "solver": "s"})
    with pytest.raises(ConfigurationError, match=r"data's agents are \['None'\].*policies' are \['planner', 'solver'\]"):
        trainer.sft(_examples(2))  # examples without an agent
    with pytest.raises(ConfigurationError, match="holds no adapter folder of a policy this trainer trains"):
        Trainer(**common, policies={"planner": "p", "solver": "s"}, init_adapter=tmp_path)._init_adapters()
    with pytest.raises(ConfigurationError, match=r"does not train: \['q'\]"):
        Trainer(**common, policies={"planner": "p", "solver": "s"}, init_adapter={"q": tmp_path})
    with pytest.raises(ConfigurationError, match=r"does not train: \['p'\]; its served names are \['policy'\]"):
        Trainer(**common, init_adapter={"p": tmp_path})  # one policy is a team of one: its name is "policy"
    with pytest.raises(ConfigurationError, match="holds no adapter folder of a policy"):
        Trainer(**common, init_adapter=tmp_path)._init_adapters()  # one policy: the folder itself is the adapter


def test_the_sft_command_takes_a_team(tmp_path):
    from click.testing import CliRunner

    from lightning_rl.cli import main

    data = tmp_path / "team.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in _team_examples()[:4]))
    result = CliRunner().invoke(main, ["sft", "--data", str(data), "--model-dir", str(ensure_tiny_model()),
                                       "--out", str(tmp_path / "sft"), "--epochs", "1", "--policy", "planner=p",
                                       "--policy", "solver=s", "--policy", "judge=j"])
    assert result.exit_code == 0, result.output
    for name in ("p", "s"):
        assert (tmp_path / "sft" / "sft_adapter" / name / "adapter_config.json").is_file()
    assert not (tmp_path / "sft" / "sft_adapter" / "j").exists()
    again = CliRunner().invoke(main, ["sft", "--data", str(data), "--model-dir", str(ensure_tiny_model()),
                                      "--out", str(tmp_path / "sft"), "--epochs", "1", "--policy", "planner=p",
                                      "--policy", "judge=s"])  # s has no data now: its old adapter must go
    assert again.exit_code == 0, again.output
    assert (tmp_path / "sft" / "sft_adapter" / "p").is_dir() and not (tmp_path / "sft" / "sft_adapter" / "s").exists()
    (line,) = [x[x.index('{"policies'):] for x in result.output.splitlines() if '{"policies' in x]
    assert json.loads(line)["sft_policies_without_data"] == ["j"]
