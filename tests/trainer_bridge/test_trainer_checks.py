"""What a trainer checks from the registries (not from names spelt in its code), and how it says that its
worker processes failed. No model, no server: nothing here gets as far as a rollout that calls one."""

from __future__ import annotations

import os

import pytest
import torch

import lightning_rl as lrl
from lightning_rl.errors import ConfigurationError, LightningRLError, WorkersFailed
from lightning_rl.trainer_bridge.algorithms import ADV_ESTIMATORS, needs_groups, register_adv_estimator
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.trainer import Trainer


# A user's group estimator, registered as docs/extending.md shows: the trainer holds it to n >= 2 as it does GRPO.
@register_adv_estimator("test_toy_leave_one_out", needs_groups=True)
def toy_leave_one_out(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, **_):
    scores = token_level_rewards.sum(dim=-1)
    out = torch.stack([scores[i] - scores[[j for j in range(len(scores)) if index[j] == index[i] and j != i]].mean()
                       for i in range(len(scores))])
    out = out.unsqueeze(-1) * response_mask
    return out, out


@register_adv_estimator("test_toy_raw_score")
def toy_raw_score(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **_):
    out = token_level_rewards.sum(dim=-1).unsqueeze(-1) * response_mask
    return out, out


def _trainer(store, tmp_path, **kwargs) -> Trainer:
    return Trainer(agent=lambda task: 1.0, tasks=[{}], store=store, model_dir="unused", server_url="http://127.0.0.1:9",
                   out_dir=tmp_path, progress=False, **kwargs)


def test_the_estimators_declare_whether_they_need_groups():
    assert needs_groups("grpo") and not needs_groups("batch_baseline")
    assert needs_groups("test_toy_leave_one_out") and not needs_groups("test_toy_raw_score")
    with pytest.raises(lrl.UnknownNameError, match="unknown advantage estimator 'nope'; known: batch_baseline, grpo"):
        needs_groups("nope")
    with pytest.raises(ConfigurationError, match="declares no trait 'needs_group'"):
        ADV_ESTIMATORS.register("test_toy_misspelt", needs_group=True)


def test_a_registered_group_estimator_is_refused_with_n_1_as_grpo_is(sqlite_store, tmp_path):
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    assert toy_leave_one_out(rewards, torch.ones(2, 2), index=["g", "g"])[0].tolist() == [[-2.0, -2.0], [2.0, 2.0]]
    for estimator in ("grpo", "test_toy_leave_one_out"):
        with pytest.raises(ConfigurationError, match=rf"advantage estimator '{estimator}' compares the tries of a "
                                                     r"task, so it needs n >= 2 \(got n=1\).*batch_baseline"):
            _trainer(sqlite_store, tmp_path, n=1, local=LocalConfig(adv_estimator=estimator))
    # one policy of a team with a group estimator is enough to refuse n=1
    with pytest.raises(ConfigurationError, match="'test_toy_leave_one_out' compares the tries"):
        _trainer(sqlite_store, tmp_path, n=1, policies={"a": "a-lora", "b": "b-lora"},
                 local=LocalConfig(adv_estimator="test_toy_raw_score",
                                   policy_config={"b-lora": {"adv_estimator": "test_toy_leave_one_out"}}))
    assert _trainer(sqlite_store, tmp_path, n=2, local=LocalConfig(adv_estimator="test_toy_leave_one_out")).n == 2
    assert _trainer(sqlite_store, tmp_path, n=1, local=LocalConfig(adv_estimator="test_toy_raw_score")).n == 1


@lrl.trace
def exiting_agent(task):
    """Ends its worker process the hard way (module level: worker processes import it by name)."""
    os._exit(3)


def test_failed_worker_processes_raise_one_error_naming_their_codes_and_the_fix(tmp_path):
    store = lrl.SQLiteStore(tmp_path / "runs.db")
    try:
        trainer = Trainer(agent=exiting_agent, tasks=[{"i": 1}], store=store, model_dir="unused",
                          server_url="http://127.0.0.1:9", out_dir=tmp_path, n=2, processes=2, progress=False,
                          lease_seconds=5.0)
        with pytest.raises(WorkersFailed) as raised:
            trainer._run_groups(exiting_agent, [{"i": 1}], 2, "train", "test")
    finally:
        store.close()
    error = raised.value
    assert isinstance(error, LightningRLError) and isinstance(error, RuntimeError)  # `except RuntimeError` still works
    assert 3 in error.codes and "\n" not in str(error)
    failed = sum(1 for code in error.codes if code)
    assert str(error).startswith(f"{failed} of 2 worker processes exited non-zero (exit codes {error.codes}")
    assert "set processes=0" in str(error)


def test_sandboxes_reach_the_trainers_runner_and_are_refused_with_worker_processes(sqlite_store, tmp_path):
    from lightning_rl.sandbox.pool import PoolPerTask

    pools = PoolPerTask(lambda task: ("k", tmp_path))

    def score(task, box):
        return 1.0

    trainer = _trainer(sqlite_store, tmp_path, sandboxes=pools, score=score, protect=["tests"], infra_retries=1)
    runner = trainer._runner(trainer.agent)
    try:
        assert (runner.sandboxes, runner.score, runner.protect, runner.infra_retries) == (pools, score, ("tests",), 1)
    finally:
        runner.close()
    with pytest.raises(ConfigurationError, match=r"processes=2 runs the agent in worker processes: set processes=0"):
        _trainer(sqlite_store, tmp_path, sandboxes=pools, processes=2)
    with pytest.raises(ConfigurationError, match="score= runs in each try's sandbox after its agent: give sandboxes="):
        _trainer(sqlite_store, tmp_path, score=score)
