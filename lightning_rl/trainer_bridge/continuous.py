"""Continuous training from production traffic (``lightning-rl train --continuous``).

Production agents run with ``mode="prod"``; rewards arrive during the rollout or long after it
(``store.add_reward`` user feedback). Each ``step()``:

1. takes succeeded prod rollouts rewarded (``reward_name``) since the last check: a check reads
   what is new, never the store's whole history;
2. dates each rollout with the policy version that served it: the oldest version its LLM calls
   were stamped with (every process stamps from the publishes recorded in the store);
3. drops (and counts) rollouts more than ``max_policy_lag`` versions behind the current one;
4. keeps the samples it can train on: rewarded calls to ``served_name`` (not the base model or
   another LoRA) sampled as the trainer computes log-probs, at ``local.temperature`` (a call sent
   without one: the API's default, 1.0) with no top-p, top-k or min-p truncation. Others are
   counted, and a rollout with none left does not count towards ``min_new``;
5. when at least ``min_new`` fresh rollouts with samples exist, updates with an estimator that
   needs no groups (``batch_baseline`` by default) and publishes version + 1.

State (published versions with their times, used and dropped rollout ids, the position in the
store's rewards, rollouts rewarded while running, rewarded rollouts waiting for ``min_new``) is kept in
``out_dir/continuous_state.json``, so a restarted trainer resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..diagnostics import report_failure
from ..records import Mode, RolloutStatus, Sample, Trajectory
from ..store.base import Store
from ..store.samples import SampleStats, trajectory_samples
from .local import LocalBackend, LocalConfig
from .publishers import Publisher, make_publisher, publish_and_record


@dataclass
class ContinuousTrainer:
    store: Store
    model_dir: str | Path
    server_url: str
    out_dir: str | Path = ".cache/continuous"
    served_name: str = "policy"
    min_new: int = 32
    max_policy_lag: int = 2
    reward_name: str = "reward"
    credit: str = "final"
    level: str = "call"
    agents: Any = None
    local: LocalConfig = field(default_factory=lambda: LocalConfig(adv_estimator="batch_baseline"))
    seed: int = 0
    publisher: Publisher | None = None

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.out_dir / "continuous_state.json"
        self.metrics_path = self.out_dir / "metrics.jsonl"
        if self.state_path.exists():
            self.state = json.loads(self.state_path.read_text())
        else:
            self.state = {"published": [], "used": [], "dropped": []}
        self.backend: LocalBackend | None = None
        self._waiting: dict[str, Trajectory] = {}  # fresh, rewarded, not yet trained on
        self._dropped_since_update = 0
        # samples of rollouts not kept since the last update: other model, other sampling, and SampleStats
        self._skipped_since_update: dict[str, int] = {"other_model": 0, "other_sampling": 0}
        self._stats_since_update = SampleStats()
        self.last_check: dict[str, int] = {}

    @property
    def version(self) -> int:
        return self.state["published"][-1][0] if self.state["published"] else -1

    def start(self) -> None:
        """Load the model and publish the current adapter (version 0 on a first start)."""
        self.backend = LocalBackend(self.model_dir, self.local, seed=self.seed)
        adapters = self.out_dir / "adapters"
        if self.state["published"]:  # resume from the last published adapter
            import peft

            last = adapters / f"v{self.version:05d}"
            peft.set_peft_model_state_dict(self.backend.model, peft.load_peft_weights(str(last)))
        self.publisher = self.publisher or make_publisher(
            "vllm_lora", server_url=self.server_url, adapter_dir=adapters, served_name=self.served_name)
        self._publish(max(self.version, 0))
        for rid in self.state.get("waiting", []):  # fresh rollouts a stopped trainer had not used yet
            self._waiting[rid] = self.store.trajectory(rid, credit=self.credit, reward_name=self.reward_name)

    def _publish(self, version: int) -> None:
        publish_and_record(self.publisher, self.store, self.backend.model, version)
        if not self.state["published"] or self.state["published"][-1][0] != version:
            self.state["published"].append([version, time.time()])
        self._save()

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.state_path)

    def served_version(self, traj: Trajectory) -> int:
        """The policy version that served ``traj``: the rollout's own (the oldest version its LLM
        calls were stamped with, from the store's publishes); for rollouts recorded without one, the
        last publish before the rollout started."""
        if traj.policy_version is not None:
            return traj.policy_version
        before = [v for v, t in self.state["published"] if t <= traj.start_time]
        return before[-1] if before else 0

    def step(self) -> dict[str, Any] | None:
        """One check of the store; returns the update's metrics, or None when there is not enough.

        A check reads what is new: rollouts rewarded since the last check (a position in the
        store's rewards), plus those still running when their reward came. Trajectories waiting
        for ``min_new`` are kept, not assembled again."""
        if self.backend is None:
            self.start()
        began = time.perf_counter()
        ids, position = self.store.rewarded_since(self.state.get("reward_position", 0), name=self.reward_name)
        # A waiting rollout rewarded again is read again (its reward changed); nothing else is.
        seen = set(self.state["used"]) | set(self.state["dropped"])
        pending: list[str] = []
        dropped = assembled = 0
        # rollouts left with no sample to train on (without_samples), and those of them that lost samples for
        # calling another model or sampling otherwise
        rejected = {"without_samples": 0, "other_model": 0, "other_sampling": 0}
        for rid in dict.fromkeys([*self.state.get("pending", []), *ids]):
            if rid in seen:
                continue
            rollout = self.store.get_rollout(rid)
            if rollout.mode != Mode.PROD:
                continue
            if rollout.status == RolloutStatus.RUNNING:
                pending.append(rid)  # rewarded mid-run: look again when it has ended
                continue
            if rollout.status != RolloutStatus.SUCCEEDED:
                continue
            traj = self.store.trajectory(rid, credit=self.credit, reward_name=self.reward_name)
            assembled += 1
            if traj.final_reward is None:
                continue
            if self.version - self.served_version(traj) > self.max_policy_lag:
                self.state["dropped"].append(rid)
                dropped += 1
                continue
            kept, stats, skipped = self._trainable(traj)
            if kept:
                self._waiting[rid] = traj
                continue
            self._stats_since_update.add(stats)  # nothing to train on: counted, never waiting
            rejected["without_samples"] += 1
            for why, n in skipped.items():
                self._skipped_since_update[why] += n
                rejected[why] += bool(n)
        self.state.update(reward_position=position, pending=pending, waiting=list(self._waiting))
        self._save()
        self.last_check = {"rewarded_new": len(ids), "assembled": assembled, "pending": len(pending),
                           "waiting": len(self._waiting), "dropped_stale": dropped, **rejected}
        if rejected["other_model"] or rejected["other_sampling"]:
            self._warn_skipped(rejected)
        self._dropped_since_update += dropped
        if len(self._waiting) < self.min_new:
            return None
        fresh = list(self._waiting.values())
        samples, stats = [], SampleStats()
        stats.add(self._stats_since_update)
        skipped = dict(self._skipped_since_update)
        for traj in fresh:
            kept, s, why = self._trainable(traj)
            stats.add(s)
            samples += kept
            for key, n in why.items():
                skipped[key] += n
        if not samples:  # waiting rollouts read back by a trainer started with other settings (agents, level)
            return None
        read = time.perf_counter()
        metrics = self.backend.update(samples)
        trained = time.perf_counter()
        self.state["used"] += [t.rollout_id for t in fresh]
        self._waiting.clear()
        self.state["waiting"] = []
        self._publish(self.version + 1)
        published = time.perf_counter()
        line = {"version": self.version, "rollouts": len(fresh),
                "dropped_stale": self._dropped_since_update,
                "prefix_splits": stats.splits, "calls_without_engine_ids": stats.missing_token_ids,
                "unrewarded_samples": stats.skipped_unrewarded,
                "skipped_other_model": skipped["other_model"], "skipped_other_sampling": skipped["other_sampling"],
                "train_reward": sum(t.final_reward for t in fresh) / len(fresh), **metrics,
                "read_seconds": read - began, "update_seconds": trained - read, "publish_seconds": published - trained,
                "time": time.time()}
        self._dropped_since_update = 0
        self._skipped_since_update = {"other_model": 0, "other_sampling": 0}
        self._stats_since_update = SampleStats()
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return line

    def _reproducible(self, sampling: dict[str, Any]) -> bool:
        """Whether a call sampled with ``sampling`` (its recorded request parameters) drew its tokens
        from the distribution the trainer computes: softmax(logits / local.temperature), untruncated."""
        temperature = sampling.get("temperature")
        temperature = 1.0 if temperature is None else temperature  # not sent: the API's default
        if not isinstance(temperature, (int, float)) or abs(temperature - self.local.temperature) > 1e-6:
            return False
        top_p, top_k, min_p = sampling.get("top_p"), sampling.get("top_k"), sampling.get("min_p")
        return (top_p is None or top_p >= 1) and top_k in (None, 0, -1) and not min_p

    def _trainable(self, traj: Trajectory) -> tuple[list[Sample], SampleStats, dict[str, int]]:
        """``traj``'s rewarded samples of calls to ``served_name`` sampled as the trainer computes;
        with the sample counts and the samples left out, by reason."""
        found, stats = trajectory_samples(traj, level=self.level, agents=self.agents)
        calls = {c.index: c for c in traj.llm_calls}
        kept: list[Sample] = []
        skipped = {"other_model": 0, "other_sampling": 0}
        for sample in found:
            if sample.reward is None:
                stats.skipped_unrewarded += 1
            elif sample.policy is not None and sample.policy != self.served_name:
                skipped["other_model"] += 1
            elif not all(self._reproducible(calls[i].sampling_params) for i in sample.llm_call_indices if i in calls):
                skipped["other_sampling"] += 1
            else:
                kept.append(sample)
        return kept, stats, skipped

    def _warn_skipped(self, rejected: dict[str, int]) -> None:
        if rejected["other_sampling"]:
            report_failure("continuous: production calls sampled otherwise", message=(
                f"lightning-rl: {rejected['other_sampling']} rewarded production rollout(s) were sampled at another "
                f"temperature than the trainer's ({self.local.temperature}), or with top-p/top-k/min-p; the trainer "
                "computes log-probs at its temperature, untruncated, so they are not trained on. Give the trainer "
                "the agents' temperature (--temperature) (logged once)"))
        if rejected["other_model"]:
            report_failure("continuous: production calls to another model", message=(
                f"lightning-rl: {rejected['other_model']} rewarded production rollout(s) called only models other "
                f"than {self.served_name!r} (the trained LoRA); they are not trained on (logged once)"))

    def run(self, *, interval: float = 10.0, max_updates: int | None = None) -> None:
        updates = 0
        while max_updates is None or updates < max_updates:
            if self.step() is not None:
                updates += 1
            else:
                time.sleep(interval)
