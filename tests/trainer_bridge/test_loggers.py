"""Experiment trackers: each logger writes a run that its own reader opens, with verl's metric names."""

from __future__ import annotations

import json
import time

import pytest

from lightning_rl.errors import ConfigurationError, UnknownNameError
from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.trainer_bridge.continuous import ContinuousTrainer
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.loggers import check_loggers, tracker_metrics
from lightning_rl.trainer_bridge.publishers import make_publisher

from ..conftest import ensure_tiny_model
from .test_sources import _prod_rollout

VERL_KEYS = {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "critic/rewards/mean"}


def test_metric_names_follow_verl_and_the_rest_are_ours():
    line = {"step": 3, "train_reward": 0.5, "pg_clipfrac": 0.1, "loss": -0.2, "response_tokens_mean": 20.0,
            "rollout_is_mean": 1.0, "staleness": {"0": 6, "2": 2}, "outcomes": {"succeeded": 7, "failed": 1},
            "engine_logprob_gap": 1e-7, "note": "text is left out", "nan": float("nan"), "flag": True,
            "policies": {"planner-lora": {"pg_clipfrac": 0.3, "samples": 4.0}}}
    got = tracker_metrics(line)
    assert got == {
        "training/global_step": 3.0, "critic/score/mean": 0.5, "actor/pg_clipfrac": 0.1, "actor/pg_loss": -0.2,
        "response_length/mean": 20.0, "rollout_corr/rollout_is_mean": 1.0,
        "training/off_policy/trajectory_staleness/mean": 0.5, "training/off_policy/trajectory_staleness/max": 2.0,
        "lightning_rl/staleness/0": 6.0, "lightning_rl/staleness/2": 2.0,
        "lightning_rl/outcomes/succeeded": 7.0, "lightning_rl/outcomes/failed": 1.0,
        "lightning_rl/engine_logprob_gap": 1e-7,
        "planner-lora/actor/pg_clipfrac": 0.3, "planner-lora/lightning_rl/samples": 4.0}
    assert tracker_metrics({"step": 0, "eval_success": 0.25})["val/success"] == 0.25


def test_bad_logger_specs_are_refused_before_a_run_with_the_fix():
    with pytest.raises(UnknownNameError, match="unknown logger 'tensorbord'; known: mlflow, tensorboard, wandb"):
        check_loggers(["tensorbord"])
    with pytest.raises(ConfigurationError, match="a list of names"):
        check_loggers("wandb")
    with pytest.raises(ConfigurationError, match="with log, log_samples and close"):
        check_loggers([object()])


def _wandb_records(path):
    """The records of a W&B run file: its header, then LevelDB's log format (32 KiB blocks of chunks,
    each chunk a CRC, a length and a type: full, first, middle, last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def _wandb_history(run_dir) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    rows = []
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow", "wandb"])
def test_each_tracker_gets_the_training_curves_and_sample_tables(tmp_path, tracker, monkeypatch):
    pytest.importorskip("peft")
    pytest.importorskip({"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}[tracker])
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = SQLiteStore(tmp_path / "s.db")
    out = tmp_path / "run"
    trainer = ContinuousTrainer(store=store, model_dir=ensure_tiny_model(), server_url="http://127.0.0.1:9",
                                out_dir=out, min_new=2, max_policy_lag=1, loggers=[tracker], run_name="lrl-test",
                                local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2),
                                publisher=make_publisher("adapter_dir", adapter_dir=out / "adapters"))
    trainer.start()
    for version in (0, 1):
        _prod_rollout(store, f"a{version}", version, reward=1.0)
        _prod_rollout(store, f"b{version}", version, reward=0.0)
        assert trainer.step() is not None
    trainer.close()
    store.close()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2]  # the record is written as before

    if tracker == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard" / "lrl-test"), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        assert VERL_KEYS <= set(events.Tags()["scalars"])
        assert [e.step for e in events.Scalars("actor/pg_loss")] == [1, 2]
        assert [e.value for e in events.Scalars("actor/pg_loss")] == pytest.approx([x["loss"] for x in lines])
        samples = events.Tensors("samples/text_summary")
        assert [s.step for s in samples] == [1, 2]
        assert "rollout_id" in samples[0].tensor_proto.string_val[0].decode()
    elif tracker == "mlflow":
        import mlflow

        mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        (run,) = mlflow.search_runs(experiment_names=["lightning-rl"], output_format="list")
        assert run.info.run_name == "lrl-test" and run.info.status == "FINISHED"
        assert VERL_KEYS <= set(run.data.metrics)
        history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "actor/pg_loss")
        assert [m.step for m in history] == [1, 2]
        assert [m.value for m in history] == pytest.approx([x["loss"] for x in lines])
        assert run.data.params["min_new"] == "2"
        artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "samples")]
        assert artifacts == ["samples/step_00001.json", "samples/step_00002.json"]
    else:
        (run_dir,) = (out / "wandb").glob("offline-run-*")
        # wandb's service process writes the run file: on a loaded machine (a fresh-clone make test, 2026-11-29) it
        # once held no history record yet when read; it is read again until both steps are there (30 s at most)
        deadline = time.monotonic() + 30
        while True:
            steps = [h for h in _wandb_history(run_dir) if "actor/pg_loss" in h]
            if len(steps) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert [h["_step"] for h in steps] == [1, 2]
        assert [h["actor/pg_loss"] for h in steps] == pytest.approx([x["loss"] for x in lines])
        assert VERL_KEYS <= set(steps[0])
        tables = sorted((run_dir / "files" / "media" / "table").glob("samples_*.table.json"))
        assert [t.name.split("_")[1] for t in tables] == ["1", "2"]  # a wandb.Table per step
        table = json.loads(tables[0].read_text())
        assert table["columns"][:2] == ["rollout_id", "group_id"] and len(table["data"]) == 2


def test_the_gates_figures_reach_the_trackers_and_its_text_does_not():
    from lightning_rl.trainer_bridge.loggers import tracker_metrics

    line = {"version": 3, "gate_decision": "refused", "gate_promoted": 0, "gate_lower_bound": -0.4, "gate_df": None,
            "gate_not_worse": False, "candidate_version": 4, "candidate_adapter": "/x/candidates/v00004.1"}
    found = tracker_metrics(line)
    assert found["lightning_rl/gate_promoted"] == 0.0 and found["lightning_rl/gate_lower_bound"] == -0.4
    assert found["lightning_rl/candidate_version"] == 4.0
    assert not any("decision" in k or "adapter" in k or "gate_df" in k for k in found)
