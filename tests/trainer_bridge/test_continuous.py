"""The continuous trainer on a stored production stream, without a server (adapters saved, not served)."""

from __future__ import annotations

import pytest

from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.trainer_bridge.continuous import ContinuousTrainer
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.publishers import make_publisher

from ..conftest import ensure_tiny_model
from .test_sources import _prod_rollout

pytest.importorskip("peft")


def _trainer(store, out) -> ContinuousTrainer:
    return ContinuousTrainer(store=store, model_dir=ensure_tiny_model(), server_url="http://127.0.0.1:9", out_dir=out,
                             min_new=2, max_policy_lag=1, local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2),
                             publisher=make_publisher("adapter_dir", adapter_dir=out / "adapters"))


def test_a_trainer_stopped_after_its_publish_resumes_at_that_version_with_its_weights(tmp_path):
    """Found in review: a trainer stopped between a publish and saving its state came back one version
    behind, published the older weights under the older number again, and trained on the batch twice."""
    import peft
    import torch

    store = SQLiteStore(tmp_path / "s.db")
    trainer = _trainer(store, tmp_path / "ct")
    trainer.start()
    _prod_rollout(store, "a", 0, reward=1.0)
    _prod_rollout(store, "b", 0, reward=0.0)

    def stopped(version):
        raise KeyboardInterrupt  # the process is stopped right after the publish was recorded

    trainer.source.published = stopped
    with pytest.raises(KeyboardInterrupt):
        trainer.step()
    def weights(backend):
        return peft.get_peft_model_state_dict(backend.model, adapter_name=backend.adapter().name)

    trained = {k: v.clone() for k, v in weights(trainer.backend).items()}
    assert [p.version for p in store.policies("policy")] == [0, 1]

    again = _trainer(store, tmp_path / "ct")
    again.start()
    assert again.version == 1 and [p.version for p in store.policies("policy")] == [0, 1, 1]
    loaded = weights(again.backend)
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)  # the published weights, not version 0's
    assert again.step() is None and again.last_check["waiting"] == 0  # its batch is not trained on twice
    _prod_rollout(store, "c", 1, reward=1.0)
    _prod_rollout(store, "d", 1, reward=0.0)
    update = again.step()
    assert update["version"] == 2 and update["rollouts"] == 2 and set(again.state["used"]) >= {"c", "d"}
    store.close()


def test_publishes_of_another_run_in_the_store_do_not_move_the_versions(tmp_path):
    """Issue 36: versions are one past what this trainer saw live (a rollback's versions included), not past
    what the served name ever had in the store: a store reused after a Trainer.fit run keeps counting from 0."""
    store = SQLiteStore(tmp_path / "s.db")
    store.record_policy("policy", 20, adapter=None)  # an earlier run's publish, its adapter gone
    trainer = _trainer(store, tmp_path / "ct")
    trainer.start()
    assert trainer.version == 0
    _prod_rollout(store, "a", 0, reward=1.0)
    _prod_rollout(store, "b", 0, reward=0.0)
    update = trainer.step()
    assert update["version"] == 1 and update["rollouts"] == 2
    assert [p.version for p in store.policies("policy")] == [20, 0, 1]
    store.close()
