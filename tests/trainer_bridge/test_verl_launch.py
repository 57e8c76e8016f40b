"""`lightning-rl train verl`: version range, the command, and our Hydra config composed with verl's."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl.cli import main
from lightning_rl.trainer_bridge.verl_launch import CONFIG_DIR, CONFIG_NAME, check_verl_version, verl_command


def test_version_range_is_named_in_the_error():
    assert check_verl_version("0.9.1") == "0.9.1" and check_verl_version("0.9.2.dev0") == "0.9.2.dev0"
    for bad in ("0.9.0", "0.8.0", "0.10.0.dev0", "1.0"):  # 0.9.0: its balancer and V1 trainer differ (refused)
        with pytest.raises(lrl.ConfigurationError, match=r"supports verl>=0.9.1,<0.10.*pip install 'verl>=0.9.1,<0.10'"):
            check_verl_version(bad)


def test_vllm_version_range():
    from lightning_rl.trainer_bridge.verl_launch import check_vllm_version

    assert check_vllm_version("0.20.2") == "0.20.2"
    with pytest.raises(lrl.ConfigurationError, match=r"needs vllm>=0.18"):
        check_vllm_version("0.12.0")


def test_print_command_passes_agent_config_and_overrides():
    result = CliRunner().invoke(main, ["train", "verl", "--agent", "pkg.agents:solve", "--print-command",
                                       "--store", "sqlite:////shared/runs.db", "trainer.n_gpus_per_node=8"])
    assert result.exit_code == 0, result.output
    assert "-m lightning_rl.trainer_bridge.verl_main" in result.output and f"--config-name {CONFIG_NAME}" in result.output
    assert "lightning_rl.agent=pkg.agents:solve" in result.output and result.output.strip().endswith("trainer.n_gpus_per_node=8")
    assert "lightning_rl.store=sqlite:////shared/runs.db" in result.output
    bad = CliRunner().invoke(main, ["train", "verl", "--agent", "no_colon"])
    assert bad.exit_code == 1 and "module:function" in bad.output
    missing = CliRunner().invoke(main, ["train", "verl", "--print-command"])
    assert missing.exit_code == 1 and "lightning_rl.rollouts=external" in missing.output
    external = CliRunner().invoke(main, ["train", "verl", "--print-command", "lightning_rl.rollouts=external"])
    assert external.exit_code == 0 and "lightning_rl.agent=" not in external.output


@pytest.mark.verl
def test_packaged_config_composes_with_verls_own_trainer_config():
    pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir

    command = verl_command("tests.trainer_bridge.verl_agents:two_turn_solver")
    overrides = [arg for arg in command if "=" in arg and not arg.startswith("--")]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(CONFIG_NAME, overrides=overrides)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.agent.default_agent_loop == "lightning_rl" and rollout.calculate_log_probs is True
    assert rollout.agent.agent_loop_config_path.endswith("agent_loops.yaml")
    assert cfg.lightning_rl.agent == "tests.trainer_bridge.verl_agents:two_turn_solver"
    assert "data" in cfg and "trainer" in cfg  # the rest is verl's own ppo_trainer


def test_a_multi_node_run_needs_the_store_server_not_a_shared_sqlite_file(monkeypatch):
    monkeypatch.delenv("LIGHTNING_RL_STORE", raising=False)
    for store in ("sqlite:////shared/runs.db", None):
        with pytest.raises(lrl.ConfigurationError, match=r"2 nodes.*SQLite.*lightning-rl store serve"):
            verl_command("pkg.agents:solve", ["trainer.nnodes=2"], store=store)
    command = verl_command("pkg.agents:solve", ["trainer.nnodes=2"], store="http://head:8765")
    assert "lightning_rl.store=http://head:8765" in command
    assert verl_command("pkg.agents:solve", ["trainer.nnodes=1"], store="sqlite:///runs.db")  # one node: fine


@pytest.mark.verl
def test_a_multi_node_run_takes_several_store_servers_or_postgresql():
    """Hydra reads an unquoted comma as a sweep (a choice of stores, not one store of several servers), and a
    PostgreSQL store is one every node can write."""
    pytest.importorskip("hydra")
    from hydra.core.override_parser.overrides_parser import OverridesParser

    servers = "http://store-a:8765,http://store-b:8765"
    command = verl_command("pkg.agents:solve", ["trainer.nnodes=2"], store=servers)
    (given,) = [arg for arg in command if arg.startswith("lightning_rl.store=")]
    assert OverridesParser.create().parse_override(given).value() == servers
    postgres = "postgresql://lrl@db:5432/lrl"
    command = verl_command("pkg.agents:solve", ["trainer.nnodes=2"], store=postgres)
    (given,) = [arg for arg in command if arg.startswith("lightning_rl.store=")]
    assert OverridesParser.create().parse_override(given).value() == postgres


@pytest.mark.verl
def test_tasks_become_verls_dataset_and_reach_the_agent_unchanged(tmp_path):
    """``train verl --tasks``: the parquet verl's own RLHFDataset reads, each row's task what the agent gets."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from lightning_rl.trainer_bridge.verl_agent_loop import task_of

    from ..conftest import ensure_tiny_model

    tasks = [{"question": "What is 12+30?", "answer": 42}, "plain text", [1, {"nested": None}], 7]
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps({"question": "held out"}) + "\n")
    result = CliRunner().invoke(main, ["train", "verl", "--agent", "pkg.agents:solve", "--print-command",
                                       "--tasks", str(tmp_path / "tasks.jsonl"), "--val-tasks",
                                       str(tmp_path / "val.jsonl"), "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert f"data.train_files={tmp_path / 'data' / 'train.parquet'}" in result.output
    assert f"data.val_files={tmp_path / 'data' / 'val.parquet'}" in result.output
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    config = OmegaConf.create({"max_prompt_length": 512, "prompt_key": "prompt", "filter_overlong_prompts": False,
                               "return_raw_chat": True, "cache_dir": str(tmp_path / "cache")})
    dataset = RLHFDataset(data_files=[str(tmp_path / "data" / "train.parquet")], tokenizer=tokenizer, config=config)
    assert len(dataset) == len(tasks)
    assert [task_of(dataset[i]) for i in range(len(tasks))] == tasks
    assert dataset[0]["agent_name"] == "lightning_rl"
    clash = CliRunner().invoke(main, ["train", "verl", "--agent", "a:b", "--print-command", "--tasks",
                                      str(tmp_path / "tasks.jsonl"), "data.train_files=/x.parquet"])
    assert clash.exit_code == 1 and "data.train_files" in clash.output
    without_val = CliRunner().invoke(main, ["train", "verl", "--agent", "a:b", "--print-command", "--tasks",
                                            str(tmp_path / "tasks.jsonl"), "--data-dir", str(tmp_path / "d2")])
    assert "trainer.val_before_train=false" in without_val.output and "trainer.test_freq=-1" in without_val.output


@pytest.mark.verl
@pytest.mark.parametrize(("override", "named"), [
    ("trainer.v1.trainer_mode=colocate_async", "trainer.v1.trainer_mode=colocate_async"),
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name=sglang"),
    ("actor_rollout_ref.model.lora.rank=16 actor_rollout_ref.model.lora.merge=false", "lora.merge=true"),
    ("trainer.use_v1=false", "trainer.use_v1=false"),
])
def test_a_setting_verl_would_run_wrongly_stops_the_launch_in_one_line(tmp_path, override, named):
    """Through the real launch (``train verl`` -> ``verl_main`` with verl's config composed): exit 1, one line
    naming the setting and the fix, before Ray or verl's trainer starts."""
    import subprocess
    import sys

    pytest.importorskip("verl")
    command = [sys.executable, "-m", "lightning_rl.cli", "train", "verl", "--agent", "pkg.agents:solve",
               "--store", f"sqlite:///{tmp_path / 'runs.db'}", *override.split()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0 and named in done.stderr and done.stderr.startswith("lightning-rl: ")
    assert not (tmp_path / "runs.db").exists()  # nothing started
