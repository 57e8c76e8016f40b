"""Continuous training from production traffic (``lightning-rl train --continuous``).

Production agents run with ``mode="prod"``; rewards arrive during the rollout or long after it
(``store.add_reward`` user feedback). Each ``step()``:

1. takes succeeded prod rollouts rewarded (``reward_name``) since the last check: a check reads
   what is new, never the store's whole history;
2. dates each rollout with the policy version that served it: the oldest version its LLM calls
   were stamped with (every process stamps from the publishes recorded in the store);
3. drops (and counts) rollouts more than ``max_policy_lag`` versions behind the current one;
4. when at least ``min_new`` fresh rewarded rollouts exist, updates with an estimator that needs
   no groups (``batch_baseline`` by default) and publishes version + 1.

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

from ..records import Mode, RolloutStatus, Trajectory
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
        ids, position = self.store.rewarded_since(self.state.get("reward_position", 0), name=self.reward_name)
        # A waiting rollout rewarded again is read again (its reward changed); nothing else is.
        seen = set(self.state["used"]) | set(self.state["dropped"])
        pending: list[str] = []
        dropped = assembled = 0
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
            else:
                self._waiting[rid] = traj
        self.state.update(reward_position=position, pending=pending, waiting=list(self._waiting))
        self._save()
        self.last_check = {"rewarded_new": len(ids), "assembled": assembled, "pending": len(pending),
                           "waiting": len(self._waiting), "dropped_stale": dropped}
        if len(self._waiting) < self.min_new:
            self._dropped_since_update += dropped
            return None
        fresh = list(self._waiting.values())
        samples, stats = [], SampleStats()
        for traj in fresh:
            found, s = trajectory_samples(traj, level=self.level, agents=self.agents)
            stats.add(s)
            samples += [x for x in found if x.reward is not None]
            stats.skipped_unrewarded += sum(1 for x in found if x.reward is None)
        if not samples:
            return None
        metrics = self.backend.update(samples)
        self.state["used"] += [t.rollout_id for t in fresh]
        self._waiting.clear()
        self.state["waiting"] = []
        self._publish(self.version + 1)
        line = {"version": self.version, "rollouts": len(fresh),
                "dropped_stale": dropped + self._dropped_since_update,
                "prefix_splits": stats.splits, "calls_without_engine_ids": stats.missing_token_ids,
                "unrewarded_samples": stats.skipped_unrewarded,
                "train_reward": sum(t.final_reward for t in fresh) / len(fresh), **metrics, "time": time.time()}
        self._dropped_since_update = 0
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return line

    def run(self, *, interval: float = 10.0, max_updates: int | None = None) -> None:
        updates = 0
        while max_updates is None or updates < max_updates:
            if self.step() is not None:
                updates += 1
            else:
                time.sleep(interval)
