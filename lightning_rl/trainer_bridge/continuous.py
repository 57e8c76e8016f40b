"""Continuous training from production traffic (``lightning-rl train --continuous``).

Production agents run with ``mode="prod"``; rewards arrive during the rollout or long after it
(``store.add_reward`` user feedback). The trainer reads them through the production stream
(``sources.ProductionStream``, the sample-source interface that ``Trainer.fit`` uses for task sets and
replays): each check reads what is new; rollouts more than ``max_policy_lag`` versions behind are
dropped and counted; only the calls the trainer can reproduce (to ``served_name``, at
``local.temperature``, untruncated) are trained on. When at least ``min_new`` fresh rollouts wait,
``step()`` updates with an estimator that needs no groups (``batch_baseline`` by default) and publishes
version + 1; ``run()`` does it without end.

State is kept in ``out_dir/continuous_state.json`` (the stream's), so a restarted trainer resumes
where it stopped, with the last published adapter; one stopped between a publish and saving its
state resumes at the version it published, without training on that batch again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store.base import Store
from .local import LocalBackend, LocalConfig
from .loggers import MetricsLog, check_loggers, make_loggers, sample_rows
from .publishers import Publisher, make_publisher, publish_and_record
from .sources import ProductionStream, StepBatch


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
    loggers: Sequence[Any] = ()  # experiment trackers beside metrics.jsonl (loggers.py)
    run_name: str | None = None

    def __post_init__(self) -> None:
        check_loggers(self.loggers)
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.source = ProductionStream(
            self.store, state_path=self.out_dir / "continuous_state.json", served_name=self.served_name,
            min_new=self.min_new, max_policy_lag=self.max_policy_lag, reward_name=self.reward_name,
            credit=self.credit, level=self.level, agents=self.agents, temperature=self.local.temperature)
        self.backend: LocalBackend | None = None
        self._metrics: MetricsLog | None = None

    @property
    def state(self) -> dict[str, Any]:
        return self.source.state

    @property
    def version(self) -> int:
        return self.source.version

    @property
    def last_check(self) -> dict[str, int]:
        return self.source.last_check

    def start(self) -> None:
        """Load the model and publish the current adapter (version 0 on a first start)."""
        self.source.start()  # first: it may adopt a publish the last run made but did not save
        self.backend = LocalBackend(self.model_dir, self.local, seed=self.seed)
        adapters = self.out_dir / "adapters"
        if self.version >= 0:  # resume from the last published adapter
            import peft

            last = adapters / f"v{self.version:05d}"
            peft.set_peft_model_state_dict(self.backend.model, peft.load_peft_weights(str(last)))
        self.publisher = self.publisher or make_publisher(
            "vllm_lora", server_url=self.server_url, adapter_dir=adapters, served_name=self.served_name)
        version = max(self.version, 0)
        publish_and_record(self.publisher, self.store, self.backend.model, version)
        self.source.published(version)

    def step(self) -> dict[str, Any] | None:
        """One check of the store; returns the update's metrics, or None when there is not enough."""
        if self.backend is None:
            self.start()
        began = time.perf_counter()
        batch = self.source.poll()
        return None if batch is None else self._update(batch, began)

    def _update(self, batch: StepBatch, began: float) -> dict[str, Any]:
        read = time.perf_counter()
        metrics = self.backend.update(batch.samples or [])
        trained = time.perf_counter()
        version = self.version + 1
        publish_and_record(self.publisher, self.store, self.backend.model, version)
        self.source.published(version)
        published = time.perf_counter()
        line = {"version": version, **batch.metrics, **metrics, "read_seconds": read - began,
                "update_seconds": trained - read, "publish_seconds": published - trained, "time": time.time()}
        if self._metrics is None:
            config = {"served_name": self.served_name, "min_new": self.min_new, "max_policy_lag": self.max_policy_lag,
                      "reward_name": self.reward_name, "credit": self.credit, "level": self.level, "seed": self.seed,
                      **{f"local.{k}": v for k, v in dataclasses.asdict(self.local).items()
                         if isinstance(v, (int, float, str, bool)) or v is None}}
            self._metrics = MetricsLog(self.metrics_path, make_loggers(
                self.loggers, self.out_dir, self.run_name or self.out_dir.resolve().name, config))
        self._metrics.write(line, version, sample_rows(batch.groups))
        return line

    def run(self, *, interval: float = 10.0, max_updates: int | None = None) -> None:
        """Update whenever enough fresh rollouts wait, checking every ``interval`` seconds."""
        if self.backend is None:
            self.start()
        self.source.interval = interval
        updates = 0
        while max_updates is None or updates < max_updates:
            began = time.perf_counter()
            batch = self.source.next_batch()
            if batch is None:  # closed
                return
            self._update(batch, began)
            updates += 1

    def close(self) -> None:
        self.source.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
