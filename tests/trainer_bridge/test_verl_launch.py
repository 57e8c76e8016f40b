"""`lightning-rl train verl`: version range, the command, and our Hydra config composed with verl's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl.cli import main
from lightning_rl.trainer_bridge.verl.launch import (CONFIG_DIR, CONFIG_NAME, check_verl_config, check_verl_version,
                                                     verl_command, verl_env)

AGENT = "tests.trainer_bridge.verl_agents:two_turn_solver"


def test_version_range_is_named_in_the_error():
    assert check_verl_version("0.9.1") == "0.9.1" and check_verl_version("0.9.2.dev0") == "0.9.2.dev0"
    for bad in ("0.9.0", "0.8.0", "0.10.0.dev0", "1.0"):  # 0.9.0: its balancer and V1 trainer differ (refused)
        with pytest.raises(lrl.ConfigurationError, match=r"supports verl>=0.9.1,<0.10.*pip install 'verl>=0.9.1,<0.10'"):
            check_verl_version(bad)


def test_vllm_version_range():
    from lightning_rl.trainer_bridge.verl.launch import check_vllm_version

    assert check_vllm_version("0.20.2") == "0.20.2"
    with pytest.raises(lrl.ConfigurationError, match=r"needs vllm>=0.18"):
        check_vllm_version("0.12.0")


def test_print_command_passes_agent_config_and_overrides():
    result = CliRunner().invoke(main, ["train", "verl", "--agent", "pkg.agents:solve", "--print-command",
                                       "--store", "sqlite:////shared/runs.db", "trainer.n_gpus_per_node=8"])
    assert result.exit_code == 0, result.output
    assert "-m lightning_rl.trainer_bridge.verl.main" in result.output and f"--config-name {CONFIG_NAME}" in result.output
    assert "lightning_rl.agent=pkg.agents:solve" in result.output and result.output.strip().endswith("trainer.n_gpus_per_node=8")
    # the store goes to verl's processes in their environment, never into verl's config (verl prints it)
    assert result.output.splitlines()[-1].startswith("LIGHTNING_RL_STORE=sqlite:////shared/runs.db ")
    assert "lightning_rl.store" not in result.output
    secret = CliRunner().invoke(main, ["train", "verl", "--agent", "pkg.agents:solve", "--print-command",
                                       "--store", "postgresql://lrl:s3cret-pw@db:5432/lrl"])
    assert secret.exit_code == 0 and "s3cret-pw" not in secret.output, secret.output
    assert "LIGHTNING_RL_STORE='postgresql://lrl:***@db:5432/lrl' " in secret.output
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
    assert not [arg for arg in command if "head:8765" in arg]  # in the environment only
    assert verl_env("http://head:8765", {})["LIGHTNING_RL_STORE"] == "http://head:8765"
    assert verl_command("pkg.agents:solve", ["trainer.nnodes=1"], store="sqlite:///runs.db")  # one node: fine


def test_a_multi_node_run_takes_several_store_servers_or_postgresql(monkeypatch):
    """Several servers of one store (comma-separated) and a PostgreSQL store reach verl's processes unchanged, in
    their environment (in a Hydra override an unquoted comma would have made a sweep)."""
    monkeypatch.delenv("LIGHTNING_RL_STORE", raising=False)
    for store in ("http://store-a:8765,http://store-b:8765", "postgresql://lrl@db:5432/lrl"):
        command = verl_command("pkg.agents:solve", ["trainer.nnodes=2"], store=store)
        assert not [arg for arg in command if "store" in arg]
        assert verl_env(store, {"PATH": "/bin"}) == {"PATH": "/bin", "LIGHTNING_RL_STORE": store}
    assert verl_env(None, {"LIGHTNING_RL_STORE": "sqlite:///runs.db"})["LIGHTNING_RL_STORE"] == (
        f"sqlite:///{Path('runs.db').resolve()}")  # a SQLite file by its full path: actors may run elsewhere


def test_a_store_url_with_a_password_never_enters_verls_config():
    """verl prints its whole config (``main_ppo``) and hands it to the experiment trackers: a store URL with a
    password given as a Hydra override is refused in one line, before anything starts."""
    for url in ("postgresql://lrl:s3cret-pw@db:5432/lrl", "http://store:8765?token=s3cret-pw"):
        with pytest.raises(lrl.ConfigurationError, match=r"lightning_rl.store=.* holds a password.*--store") as err:
            verl_command("pkg.agents:solve", [f"lightning_rl.store={url}"])
        assert "s3cret-pw" not in str(err.value)
        with pytest.raises(lrl.ConfigurationError, match=r"holds a password"):
            check_verl_config({"lightning_rl": {"store": url}})
    done = CliRunner().invoke(main, ["train", "verl", "--agent", "pkg.agents:solve", "--print-command",
                                     "lightning_rl.store=postgresql://lrl:s3cret-pw@db:5432/lrl"])
    assert done.exit_code == 1 and "s3cret-pw" not in done.output and done.output.count("\n") == 1, done.output


@pytest.mark.verl
def test_tasks_become_verls_dataset_and_reach_the_agent_unchanged(tmp_path):
    """``train verl --tasks``: the parquet verl's own RLHFDataset reads, each row's task what the agent gets."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from lightning_rl.trainer_bridge.verl.agent_loop import task_of

    from ..conftest import ensure_tiny_model

    tasks = [{"question": "What is 12+30?", "answer": 42}, "plain text", [1, {"nested": None}], 7]
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in tasks) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps({"question": "held out"}) + "\n")
    result = CliRunner().invoke(main, ["train", "verl", "--agent", AGENT, "--print-command",
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
    clash = CliRunner().invoke(main, ["train", "verl", "--agent", AGENT, "--print-command", "--tasks",
                                      str(tmp_path / "tasks.jsonl"), "data.train_files=/x.parquet"])
    assert clash.exit_code == 1 and "data.train_files" in clash.output
    without_val = CliRunner().invoke(main, ["train", "verl", "--agent", AGENT, "--print-command", "--tasks",
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
    assert done.stderr.strip().count("\n") == 0 and named in done.stderr and done.stderr.startswith("Error: ")
    assert not (tmp_path / "runs.db").exists()  # nothing started


@pytest.mark.verl
def test_the_launch_checks_the_agent_the_data_and_our_settings_before_ray(tmp_path):
    """An agent that does not import, a dataset file that does not exist, a lightning_rl setting with a typo:
    one line each, from the real launch; --print-command checks the same where verl is installed."""
    import os
    import subprocess
    import sys

    from ..conftest import ROOT

    pytest.importorskip("verl")
    (tmp_path / "tasks.jsonl").write_text('{"q": 1}\n')

    def launch(*args):
        command = [sys.executable, "-m", "lightning_rl.cli", "train", "verl", "--store",
                   f"sqlite:///{tmp_path / 'runs.db'}", *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the agent's package, as a user's is on their path
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)

    for args, named in ((["--agent", "my_pkg.agent:solve", "--tasks", "tasks.jsonl"], "cannot load agent"),
                        (["--agent", AGENT, "data.train_files=missing.parquet", "data.val_files=missing.parquet"],
                         "data.train_files=missing.parquet does not exist"),
                        (["--agent", AGENT, "--tasks", "tasks.jsonl", "+lightning_rl.rollout=external"],
                         "lightning_rl.rollout is not a lightning-rl setting"),
                        (["--agent", AGENT, "--tasks", "tasks.jsonl", "--print-command",
                          "trainer.v1.trainer_mode=colocate_async"], "trainer.v1.trainer_mode=colocate_async")):
        done = launch(*args)
        assert done.returncode == 1, (args, done.stderr[-2000:])
        assert named in done.stderr and done.stderr.strip().splitlines()[-1].startswith("Error: "), done.stderr
        assert "Traceback" not in done.stderr
    printed = launch("--agent", AGENT, "--tasks", "tasks.jsonl", "--print-command")
    assert printed.returncode == 0, printed.stderr
    # the files verl's actors open are named by their full paths (they may run in another directory)
    assert f"data.train_files={tmp_path / 'lightning_rl_verl_data' / 'train.parquet'}" in printed.stdout
    assert printed.stdout.startswith(f"LIGHTNING_RL_STORE=sqlite:///{tmp_path / 'runs.db'} ")


def test_export_model_from_a_verl_checkpoint_says_what_is_wrong_in_one_line(tmp_path):
    from lightning_rl.errors import MissingDependencyError  # noqa: F401 - what the CLI shows for a missing extra

    missing = CliRunner().invoke(main, ["export-model", "--verl-checkpoint", str(tmp_path / "nope"), "--out",
                                        str(tmp_path / "out")])
    assert missing.exit_code == 1 and "does not exist" in missing.output and missing.output.count("\n") == 1
    partial = tmp_path / "global_step_2" / "actor"
    (partial / "huggingface").mkdir(parents=True)
    (partial / "huggingface" / "config.json").write_text("{}")
    (partial / "model_world_size_1_rank_0.pt").write_bytes(b"not a checkpoint")
    done = CliRunner().invoke(main, ["export-model", "--verl-checkpoint", str(partial.parent), "--out",
                                     str(tmp_path / "out")])
    assert done.exit_code == 1 and "fsdp_config.json" in done.output and done.output.count("\n") == 1
    (partial / "fsdp_config.json").write_text("{}")
    done = CliRunner().invoke(main, ["export-model", "--verl-checkpoint", str(partial.parent), "--out",
                                     str(tmp_path / "out")])
    # without verl: the extra to install; with verl: the merger's complaint about the damaged file
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert "pip install 'lightning-rl[verl]'" in done.output or "could not read" in done.output
    assert not (tmp_path / "out").exists()
