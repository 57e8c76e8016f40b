"""verl's V1 sync trainer, with every weight sync recorded as a publish in the store.

``verl_main`` runs verl's ``TaskRunnerV1`` in an actor of its own that makes ``trainer.v1.trainer_mode=sync``
(verl's registry name, which verl's own code branches on) this class in that process (``use_in_this_process``).
It is verl's own ``PPOTrainerSync`` (colocated, no partial rollouts), plus:

* **Publishes.** After each weight sync (at start, the base or resumed weights; then after every step) the
  store records a publish of the served name (the name verl's vLLM servers answer to) with version = verl's
  global step, the checkpoint folder of that step when one was saved (``adapter``; ``lightning-rl
  export-model --verl-checkpoint`` makes an adapter or a merged model of it), and the GRPO groups the update
  was trained on (``trained_on``: verl's uids, which are the rollouts' group ids). So every process stamps
  its calls with verl's versions, and replay, the gate and rollback read them as under the local trainer.
  A publish that cannot be recorded (the store away) is counted and logged once; training goes on.
* **A run record** (``lightning_rl_run.json`` in ``trainer.default_local_dir``): the base model and served name,
  which ``export-model --verl-checkpoint`` reads.
* **Row metrics.** Each step's metrics line gets ``lightning_rl/*``: rows, segments per try, prefix splits,
  rows without gradient by reason, where the versions came from (``verl_rows``).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from ..diagnostics import report_failure
from .verl_launch import served_model_name

def checkpoint_folder(config: Any, global_steps: int) -> str | None:
    """The actor checkpoint verl saved at ``global_steps``, if it did."""
    folder = os.path.join(str(config.trainer.default_local_dir), f"global_step_{global_steps}", "actor")
    return folder if os.path.isdir(folder) else None


def write_run_record(config: Any) -> None:
    """``lightning_rl_run.json`` beside the run's checkpoints: the base model and the served name, which
    ``export-model --verl-checkpoint`` reads (a LoRA's base model). Not the store's URL: it may hold a password."""
    import json

    folder = str(config.trainer.default_local_dir)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "lightning_rl_run.json"), "w") as f:
            json.dump({"model_path": str(config.actor_rollout_ref.model.path), "served_name": served_model_name(config)},
                      f, indent=1)
    except OSError as exc:  # an export can still be given --base-model
        report_failure("writing the verl run record", exc)


def row_metrics(extra_fields: list[dict[str, Any]]) -> dict[str, float]:
    """The ``lightning_rl/*`` metrics of one step's rows (each row's ``extra_fields``, ``verl_rows``)."""
    rows = [e for e in extra_fields if isinstance(e, dict) and "segment" in e]
    if not rows:
        return {}
    ids = [e.get("rollout_id") for e in rows]
    tries = len({i for i in ids if i}) + ids.count("")  # a try no runner took has no rollout: a row of its own
    out: dict[str, float] = {"lightning_rl/rows": len(rows), "lightning_rl/tries": tries,
                             "lightning_rl/segments_per_try": len(rows) / tries,
                             "lightning_rl/prefix_splits": sum(e.get("prefix_splits", 0) for e in rows
                                                               if e.get("segment") == 0)}
    for reason, n in Counter(e.get("masked") for e in rows if e.get("masked")).items():
        out[f"lightning_rl/rows_masked/{reason}"] = n
    for source, n in Counter(e.get("version_source") for e in rows).items():
        out[f"lightning_rl/version_source/{source}"] = n
    return out


class LightningRLSyncTrainer(PPOTrainerSync):
    """verl's sync trainer; each weight sync is a publish in the store (module doc)."""

    _store: Any = None
    _trained_on: list[str] | None = None

    def on_init_end(self) -> None:
        super().on_init_end()
        write_run_record(self.config)
        self._publish()

    def on_step_end(self) -> None:
        super().on_step_end()
        self._publish()

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        batch = super().step(metrics, timing_raw)
        keys = [k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
        self._trained_on = sorted({key.rsplit("_", 2)[0] for key in keys})
        try:
            import transfer_queue as tq

            data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
            metrics.update(row_metrics(list(data["extra_fields"])))
        except Exception as exc:  # noqa: BLE001 - metrics only
            report_failure("verl row metrics", exc)
        return batch

    def _publish(self) -> None:
        from .._api import open_store

        served, version = served_model_name(self.config), int(self.global_steps)
        try:
            if self._store is None:
                self._store = open_store(self.config.lightning_rl.store)
            self._store.record_policy(served, version, adapter=checkpoint_folder(self.config, version),
                                      trained_on=self._trained_on)
        except Exception as exc:  # noqa: BLE001 - the rows still carry the servers' versions
            report_failure("recording a verl weight sync", exc, message=(
                f"lightning-rl: verl's weight sync to version {version} of {served!r} could not be recorded in the "
                f"store ({exc}); rows still carry the servers' versions (counted, logged once)"))


def use_in_this_process() -> None:
    """Make verl's ``sync`` trainer mode this class, in this process only (verl's ``TaskRunnerV1`` looks its
    trainer up by mode name; verl's code also branches on the name ``sync``, so the name stays)."""
    trainer_base.TRAINER_REGISTRY["sync"] = LightningRLSyncTrainer
