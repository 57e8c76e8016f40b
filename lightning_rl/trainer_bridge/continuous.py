"""Continuous training from production traffic (``lightning-rl train --continuous``).

Production agents run with ``mode="prod"``; rewards arrive during the rollout or long after it
(``store.add_reward`` user feedback). Each ``step()``:

1. takes succeeded prod rollouts that have a reward (of ``reward_name``) and were not used yet;
2. dates each rollout with the policy version that served it: the latest version this trainer
   published before the rollout started (agents in other processes cannot know the trainer's
   versions), or a higher one recorded on its LLM spans;
3. drops (and counts) rollouts more than ``max_policy_lag`` versions behind the current one;
4. when at least ``min_new`` fresh rewarded rollouts exist, updates with an estimator that needs
   no groups (``batch_baseline`` by default) and publishes version + 1.

State (published versions with their times, used and dropped rollout ids) is kept in
``out_dir/continuous_state.json``, so a restarted trainer resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..records import Trajectory
from ..store.base import Store
from ..store.samples import trajectory_samples
from .local import LocalBackend, LocalConfig
from .publishers import Publisher, make_publisher


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

    def _publish(self, version: int) -> None:
        self.publisher.publish(self.backend.model, version)
        if not self.state["published"] or self.state["published"][-1][0] != version:
            self.state["published"].append([version, time.time()])
        self._save()

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.state_path)

    def served_version(self, traj: Trajectory) -> int:
        before = [v for v, t in self.state["published"] if t <= traj.start_time]
        recorded = [c.policy_version for c in traj.llm_calls if c.policy_version is not None]
        return max([before[-1] if before else 0, *recorded])

    def step(self) -> dict[str, Any] | None:
        """One check of the store; returns the update's metrics, or None when there is not enough."""
        if self.backend is None:
            self.start()
        seen = set(self.state["used"]) | set(self.state["dropped"])
        fresh: list[Trajectory] = []
        dropped = 0
        # Filter on the rollouts table first: only unseen rollouts are assembled (spans read and
        # parsed), so a check costs what is new, not the store's whole history.
        for rollout in self.store.rollouts(mode="prod", status="succeeded"):
            if rollout.rollout_id in seen:
                continue
            traj = self.store.trajectory(rollout.rollout_id, credit=self.credit, reward_name=self.reward_name)
            if traj.final_reward is None:
                continue
            if self.version - self.served_version(traj) > self.max_policy_lag:
                self.state["dropped"].append(traj.rollout_id)
                dropped += 1
            else:
                fresh.append(traj)
        if dropped:
            self._save()
        if len(fresh) < self.min_new:
            return None
        samples = []
        for traj in fresh:
            samples += [s for s in trajectory_samples(traj, level=self.level, agents=self.agents)[0] if s.reward is not None]
        if not samples:
            return None
        metrics = self.backend.update(samples)
        self.state["used"] += [t.rollout_id for t in fresh]
        self._publish(self.version + 1)
        line = {"version": self.version, "rollouts": len(fresh), "dropped_stale": dropped,
                "train_reward": sum(t.final_reward for t in fresh) / len(fresh), **metrics, "time": time.time()}
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
