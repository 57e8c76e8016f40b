"""verl's V1 sync trainer, with every weight sync recorded as a publish in the store.

``main`` runs verl's ``TaskRunnerV1`` in an actor of its own that makes ``trainer.v1.trainer_mode=sync``
(verl's registry name, which verl's own code branches on) this class in that process (``use_in_this_process``).
It is verl's own ``PPOTrainerSync`` (colocated, no partial rollouts), plus:

* **Publishes.** After each weight sync (at start, the base or resumed weights; then after every step) the
  store records a publish of the served name (the name verl's vLLM servers answer to) with version = the run's
  version base + verl's global step (``version_base``: a run starts after every version of its served name
  already in the store, so two runs in one store never share a number; a resumed run keeps its base), the
  GRPO groups the update was trained on (``trained_on``: verl's uids, the rollouts' group ids) and, for a
  step verl saved a checkpoint of, what serving loads (``adapter``): the step's checkpoint exported by verl's
  own merger under ``global_step_N/lightning_rl_export/`` (``export.py``): the PEFT adapter of a LoRA run, the
  merged Hugging Face folder of a full one, which ``policies promote`` and ``policies rollback`` take. So every
  process stamps its calls with the run's versions, and replay, the gate and rollback read them as under the
  local trainer. A publish that cannot be recorded (the store away) or exported is counted and logged once;
  training goes on.
* **A run record** (``lightning_rl_run.json`` in ``trainer.default_local_dir``): the base model, the served name
  and the version base, which ``export-model --verl-checkpoint`` and a resumed run read.
* **Row metrics.** Each step's metrics line gets ``lightning_rl/*``: rows, segments per try, prefix splits,
  rows without gradient by reason, where the versions came from (``rows``).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from ...diagnostics import count, report_failure
from .advantage import compute_advantage
from .gap import gap_limit, logprob_gap
from .launch import served_model_name
from .runs import version_base, write_run_record


def checkpoint_folder(config: Any, global_steps: int) -> str | None:
    """The actor checkpoint verl saved at ``global_steps``, if it did."""
    folder = os.path.join(str(config.trainer.default_local_dir), f"global_step_{global_steps}", "actor")
    return folder if os.path.isdir(folder) else None


def exported_policy(config: Any, global_steps: int) -> str | None:
    """What serving loads for the checkpoint verl saved at ``global_steps`` (None when it saved none): its PEFT
    adapter (LoRA) or merged model folder, exported once by verl's merger under ``global_step_N/lightning_rl_export``."""
    folder = checkpoint_folder(config, global_steps)
    if folder is None:
        return None
    out = os.path.join(os.path.dirname(folder), "lightning_rl_export")
    if not os.path.isdir(out):
        from .export import export_verl_checkpoint

        export_verl_checkpoint(folder, out, base_model=str(config.actor_rollout_ref.model.path), merge=False)
    adapter = os.path.join(out, "adapter")
    return adapter if os.path.isdir(adapter) else os.path.join(out, "merged")


def row_metrics(extra_fields: list[dict[str, Any]]) -> dict[str, float]:
    """The ``lightning_rl/*`` metrics of one step's rows (each row's ``extra_fields``, ``rows``)."""
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

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        return compute_advantage(self, batch, metrics)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if getattr(self, "lightning_rl_trained_tokens", 1) == 0:  # set by compute_advantage for this batch
            count("verl_updates_skipped_no_tokens")
            report_failure("verl update skipped: no trained token", message=(
                f"lightning-rl: step {self.global_steps} has no token to train on (every group had an infrastructure "
                "failure, or every row is masked: see lightning_rl/rows_masked/*); its update is skipped, the weights "
                "stay (counted: lightning_rl/update_skipped, logged once)"))
            metrics["lightning_rl/update_skipped"] = 1
            return batch
        metrics["lightning_rl/update_skipped"] = 0
        return super()._update_actor(batch, metrics)

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        batch = super()._compute_old_log_prob(batch, metrics)
        corr = self.config.algorithm.get("rollout_correction", None)
        if (corr is not None and corr.get("bypass_mode", False)) or not self.config.actor_rollout_ref.rollout.get(
                "calculate_log_probs", False):
            return batch  # the actor's log-probs are not recomputed, or the engine's are not kept: no gap to read
        try:
            import transfer_queue as tq

            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=["rollout_log_probs", "old_log_probs", "response_mask"]).to_padded_tensor()
            limit = gap_limit(corr)
            gap = logprob_gap(data["rollout_log_probs"], data["old_log_probs"], data["response_mask"], limit)
        except Exception as exc:  # noqa: BLE001 - a metric only
            report_failure("verl served log-prob gap", exc)
            return batch
        metrics.update(gap)
        if gap["lightning_rl/served_logprob_gap_over"]:
            count("verl_logprob_gap_over", int(gap["lightning_rl/served_logprob_gap_over"]))
            report_failure("verl served log-prob gap over its limit", message=(
                f"lightning-rl: at step {self.global_steps} the engine's log-probs differ from the actor's by up to "
                f"{gap['lightning_rl/served_logprob_gap_max']:.3g} (limit {limit:.3g} = ln of "
                "algorithm.rollout_correction.rollout_is_threshold: past it the importance weights are capped and no "
                "longer correct the gap) on "
                f"{int(gap['lightning_rl/served_logprob_gap_over'])} tokens: the served weights lag the actor's (bf16 "
                "weight sync, a failed sync) or the engine sampled from another distribution (guided decoding); "
                "see lightning_rl/served_logprob_gap_* (counted, logged once)"))
        return batch

    def _publish(self) -> None:
        from ..._api import open_store

        served, version = served_model_name(self.config), version_base() + int(self.global_steps)
        try:
            adapter = exported_policy(self.config, int(self.global_steps))
        except Exception as exc:  # noqa: BLE001 - the publish is still recorded, without a folder to load
            adapter = None
            report_failure("exporting a verl checkpoint for its publish", exc)
        try:
            if self._store is None:
                self._store = open_store(self.config.lightning_rl.get("store") or None)  # None: LIGHTNING_RL_STORE
            self._store.record_policy(served, version, adapter=adapter, trained_on=self._trained_on)
        except Exception as exc:  # noqa: BLE001 - the rows still carry the servers' versions
            report_failure("recording a verl weight sync", exc, message=(
                f"lightning-rl: verl's weight sync to version {version} of {served!r} could not be recorded in the "
                f"store ({exc}); rows still carry the servers' versions (counted, logged once)"))


def use_in_this_process() -> None:
    """Make verl's ``sync`` trainer mode this class, in this process only (verl's ``TaskRunnerV1`` looks its
    trainer up by mode name; verl's code also branches on the name ``sync``, so the name stays)."""
    trainer_base.TRAINER_REGISTRY["sync"] = LightningRLSyncTrainer
