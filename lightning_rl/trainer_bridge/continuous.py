"""Continuous training from production traffic (``lightning-rl train continuous``).

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

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr

from .config import ConfigModel, Count, Credit, LocalConfig, Loggers, Name, NonNegativeInt
from .local import LocalBackend, load_adapter
from .loggers import MetricsLog, make_loggers, sample_rows
from .publishers import Publisher, make_publisher, publish_and_record
from .sources import ProductionStream, StepBatch


class ContinuousTrainer(ConfigModel):
    """Train the served LoRA from production rollouts as their rewards arrive (module doc). Keyword
    arguments only, validated when it is made (``config.py``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: Any = Field(repr=False)
    model_dir: Path
    server_url: str
    out_dir: Path = Path(".cache/continuous")
    served_name: Name = "policy"
    min_new: Count = Field(32, description="fresh rewarded rollouts per update")
    max_policy_lag: NonNegativeInt = Field(2, description="versions a rollout may be behind")
    reward_name: Name = "reward"
    credit: Credit = "final"
    level: Literal["call", "trajectory"] = "call"
    agents: str | Sequence[str] | None = None
    local: LocalConfig = Field(default_factory=lambda: LocalConfig(adv_estimator="batch_baseline"))
    seed: Annotated[int, Field(strict=True)] = 0
    publisher: Any = None  # default: vllm_lora for served_name, adapters in out_dir/adapters
    loggers: Loggers = ()  # experiment trackers beside metrics.jsonl (loggers.py)
    run_name: str | None = None

    _source: ProductionStream = PrivateAttr()
    _backend: LocalBackend | None = PrivateAttr(None)
    _publisher: Publisher | None = PrivateAttr(None)
    _metrics: MetricsLog | None = PrivateAttr(None)

    def model_post_init(self, context: Any) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._source = ProductionStream(
            self.store, state_path=self.out_dir / "continuous_state.json", served_name=self.served_name,
            min_new=self.min_new, max_policy_lag=self.max_policy_lag, reward_name=self.reward_name,
            credit=self.credit, level=self.level, agents=self.agents, temperature=self.local.temperature)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    @property
    def source(self) -> ProductionStream:
        return self._source

    @property
    def backend(self) -> LocalBackend | None:
        """The model being trained (None until ``start``)."""
        return self._backend

    @property
    def state(self) -> dict[str, Any]:
        return self._source.state

    @property
    def version(self) -> int:
        return self._source.version

    @property
    def last_check(self) -> dict[str, int]:
        return self._source.last_check

    def start(self) -> None:
        """Load the model and publish the current adapter (version 0 on a first start)."""
        self._source.start()  # first: it may adopt a publish the last run made but did not save
        self._backend = LocalBackend(self.model_dir, self.local, seed=self.seed, policies=[self.served_name])
        adapters = self.out_dir / "adapters"
        if self.version >= 0:  # resume from the last published adapter
            load_adapter(self._backend, adapters / f"v{self.version:05d}")
        self._publisher = self.publisher or make_publisher(
            "vllm_lora", server_url=self.server_url, adapter_dir=adapters, served_name=self.served_name)
        version = max(self.version, 0)
        publish_and_record(self._publisher, self.store, self._backend.adapter(), version)
        self._source.published(version)

    def step(self) -> dict[str, Any] | None:
        """One check of the store; returns the update's metrics, or None when there is not enough."""
        if self._backend is None:
            self.start()
        began = time.perf_counter()
        batch = self._source.poll()
        return None if batch is None else self._update(batch, began)

    def _update(self, batch: StepBatch, began: float) -> dict[str, Any]:
        read = time.perf_counter()
        metrics = self._backend.update(batch.samples or [])
        trained = time.perf_counter()
        version = self.version + 1
        publish_and_record(self._publisher, self.store, self._backend.adapter(), version)
        self._source.published(version)
        published = time.perf_counter()
        line = {"version": version, **batch.metrics, **metrics, "read_seconds": read - began,
                "update_seconds": trained - read, "publish_seconds": published - trained, "time": time.time()}
        if self._metrics is None:
            config = {"served_name": self.served_name, "min_new": self.min_new, "max_policy_lag": self.max_policy_lag,
                      "reward_name": self.reward_name, "credit": self.credit, "level": self.level, "seed": self.seed,
                      **{f"local.{k}": v for k, v in self.local.scalars().items()}}
            self._metrics = MetricsLog(self.metrics_path, make_loggers(
                self.loggers, self.out_dir, self.run_name or self.out_dir.resolve().name, config))
        self._metrics.write(line, version, sample_rows(batch.groups))
        return line

    def run(self, *, interval: float = 10.0, max_updates: int | None = None) -> None:
        """Update whenever enough fresh rollouts wait, checking every ``interval`` seconds."""
        if self._backend is None:
            self.start()
        self._source.interval = interval
        updates = 0
        while max_updates is None or updates < max_updates:
            began = time.perf_counter()
            batch = self._source.next_batch()
            if batch is None:  # closed
                return
            self._update(batch, began)
            updates += 1

    def close(self) -> None:
        self._source.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
