"""Continuous training from production traffic (``lightning-rl train continuous``).

Production agents run with ``mode="prod"``; rewards arrive during the rollout or long after it
(``store.add_reward`` user feedback). The trainer reads them through the production stream
(``sources.ProductionStream``, the sample-source interface that ``Trainer.fit`` uses for task sets and
replays): each check reads what is new; rollouts more than ``max_policy_lag`` versions behind are
dropped and counted; only the calls the trainer can reproduce (to ``served_name``, at
``local.temperature``, untruncated) are trained on. When at least ``min_new`` fresh rollouts wait,
``step()`` updates with an estimator that needs no groups (``batch_baseline`` by default) and publishes
the next version; ``run()`` does it without end.

Going live is decided in ``going_live.py`` (``GoingLive``, a base of ``ContinuousTrainer``): with
``gate_tasks`` and ``gate_agent`` an update is a candidate the gate judges, with ``canary`` it first serves
a share of production, with ``rollback_watch`` a publish whose production reward drops is rolled back, and
a rollback made by hand is followed (its module doc says how).

``server_url`` may be a replica set (a list or a comma list of vLLM servers, ``replicas.py``): publishes,
the gate, the canary and rollbacks reach every replica. At every check of the store the replicas are
reconciled with the live publish (a replica that restarted gets it back, and the canary's candidate).
A publish that a replica still refuses after its retries (``PublishError``) is reported (counted as
``continuous_publish_failures``, logged) and treated as a refusal: the live version stays on every
replica, the batch counts as used, and training goes on from the live weights.

State is kept in ``out_dir/continuous_state.json`` (the stream's), so a restarted trainer resumes
where it stopped, with the last published adapter; one stopped between a publish and saving its
state resumes at the version it published, without training on that batch again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr

from ..diagnostics import report_failure
from ..errors import ConfigurationError, PublishError
from .config import ConfigModel, Count, Credit, Flag, LocalConfig, Loggers, Name, NonNegativeInt, Positive
from .gate import Gate
from .going_live import GoingLive
from .local import LocalBackend, load_adapter
from .loggers import MetricsLog, make_loggers, sample_rows
from .publishers import Publisher, make_publisher, publish_and_record
from .replicas import Replicas
from .sources import ProductionStream, StepBatch

log = logging.getLogger(__name__)
Fraction = Annotated[float, Field(strict=True, ge=0.5, lt=1.0)]
Share = Annotated[float, Field(strict=True, ge=0.0, lt=1.0)]


class ContinuousTrainer(GoingLive, ConfigModel):
    """Train the served LoRA from production rollouts as their rewards arrive (module doc). Keyword
    arguments only, validated when it is made (``config.py``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: Any = Field(repr=False)
    model_dir: Path
    server_url: str | list[str]  # one vLLM server, or a replica set (a list, or a comma list)
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
    gate_tasks: Sequence[Any] = Field((), repr=False)  # the gate before going live (going_live.py); () : none
    gate_agent: Callable[[Any], Any] | None = Field(None, repr=False)  # calls lrl.current_endpoint()'s model
    gate_n: Count = Field(1, description="tries per gate task, for the candidate and the live policy each")
    gate_margin: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)] = 0.1  # reward it may lose
    gate_confidence: Fraction = 0.9  # of the one-sided lower bound (noninferiority.py)
    gate_timeout: Positive = 120.0  # seconds per gate try
    rollback_watch: Flag = False  # after each publish, restore the previous version if production reward drops
    watch_min_rollouts: Count = Field(16, description="rewarded production rollouts of a new version before it is "
                                      "judged by the rollback watch")
    canary: Share = 0.0  # share of production rollouts a candidate serves before it goes live; 0: no canary
    canary_min_rollouts: Count = Field(16, description="rewarded canary rollouts before the canary is judged")
    canary_timeout: Positive = 600.0  # seconds: a candidate without enough canary feedback by then is refused

    _source: ProductionStream = PrivateAttr()
    _backend: LocalBackend | None = PrivateAttr(None)
    _publisher: Publisher | None = PrivateAttr(None)
    _metrics: MetricsLog | None = PrivateAttr(None)
    _gate: Gate | None = PrivateAttr(None)
    _live_adapter: str | None = PrivateAttr(None)  # where the live policy's weights are
    _watching: tuple[int, int] | None = PrivateAttr(None)  # (version published, the one it replaced)
    _pending: dict[str, Any] | None = PrivateAttr(None)  # the update on canary: its metrics line so far
    _replicas: Replicas = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        if bool(self.gate_tasks) != (self.gate_agent is not None):
            raise ConfigurationError("the gate needs both gate_tasks (held-out tasks) and gate_agent (the traced "
                                     f"agent that runs them); got {len(self.gate_tasks)} task(s) and gate_agent="
                                     f"{'set' if self.gate_agent is not None else 'None'}")
        if self.gate_tasks and len(self.gate_tasks) * self.gate_n < 2:
            raise ConfigurationError(f"the gate needs at least 2 tries per policy; got {len(self.gate_tasks)} task(s) "
                                     f"x gate_n={self.gate_n}: give more gate tasks or raise gate_n")
        self._replicas = Replicas(self.server_url)
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
        self._follow_live()  # rolled back while stopped: go on from that version
        self._end_stranded_canary()
        self._publisher = self.publisher or make_publisher(
            "vllm_lora", server_url=self._replicas, adapter_dir=adapters, served_name=self.served_name)
        version = max(self.version, 0)
        self._live_adapter = publish_and_record(self._publisher, self.store, self._backend.adapter(), version)
        self._source.published(version)
        if self.gate_tasks:
            if self._live_adapter is None:
                raise ConfigurationError("the gate reloads the live policy's weights after a refusal, and publisher= "
                                         f"{self._publisher!r} returned no adapter path; return the saved folder")
            self._gate = Gate(self.store, self.gate_agent, self.gate_tasks, server_url=self._replicas,
                              served_name=self.served_name, n=self.gate_n, margin=self.gate_margin,
                              confidence=self.gate_confidence, timeout=self.gate_timeout)

    def step(self) -> dict[str, Any] | None:
        """One check of the store; returns the update's metrics, or None when there is not enough."""
        if self._backend is None:
            self.start()
        self._follow_live()
        began = time.perf_counter()
        batch = self._source.poll()
        canary = self._pending
        if not self._on_check(batch):
            return None
        if canary is not None and self._pending is None:  # this check ended a canary: its update's line
            return canary["line"]
        return None if batch is None else self._update(batch, began)

    def _update(self, batch: StepBatch, began: float) -> dict[str, Any]:
        read = time.perf_counter()
        metrics = self._backend.update(batch.samples or [])
        trained = time.perf_counter()
        version = self._next_version()
        gate: dict[str, Any] = {}
        if self._gate is not None:
            gate = self._judge(version)
            gated = time.perf_counter()
            gate["gate_seconds"] = gated - trained
            trained = gated
        if self.canary and (not gate or gate["gate_decision"] == "promoted"):
            self._start_canary(version, batch, gate, metrics, began, read, trained)
            return self._pending["line"]
        if not gate or gate["gate_decision"] == "promoted":
            live = self.version
            failed = self._publish(version)
            if failed is not None:  # no replica serves it (module doc): the reason goes in the line
                gate = {**gate, "publish_failed": 1, "publish_error": failed}
            else:
                self._watching = (version, live) if self.rollback_watch else None
                if gate:
                    self._record(gate, "promoted", live)
        else:  # refused: the batch is used, the live policy stays, and training goes on from its weights
            self._source.discarded()
            load_adapter(self._backend, self._live_adapter)
            self._record(gate, "refused", self.version)
        published = time.perf_counter()
        line = {"version": self.version, **gate, **batch.metrics, **metrics, "read_seconds": read - began,
                "update_seconds": trained - read - gate.get("gate_seconds", 0.0),
                "publish_seconds": published - trained, "time": time.time()}
        self._write(line, batch, version)
        return line

    def _publish(self, version: int) -> str | None:
        """Publish the local model as ``version`` on every replica and record it; returns None, or the error
        of a publish no replica serves (module doc: reported, counted; the trainer goes on from the live
        weights, the batch counted as used)."""
        try:
            self._live_adapter = publish_and_record(self._publisher, self.store, self._backend.adapter(), version)
        except PublishError as exc:
            report_failure("continuous_publish_failures", exc, message=(
                f"lightning-rl: version {version} of {self.served_name!r} was not published: {exc}; the live "
                f"version {self.version} stays, and training goes on from its weights (counted as "
                "continuous_publish_failures, logged once)"))
            log.warning("lightning-rl: publish of v%d failed: %s", version, exc)
            self._source.discarded()
            load_adapter(self._backend, self._live_adapter)
            return str(exc)
        self._source.published(version)
        return None

    def reconcile(self) -> dict[str, list[str]]:
        """Load the live publish (and the canary's candidate) on every replica that lacks it (``replicas.py``);
        returns what was loaded, by replica. A replica that cannot be reconciled is reported (counted as
        ``replica_reconcile_failures``, logged once) and tried again at the next check."""
        if self.publisher is not None:  # a publisher of the user's: its replicas are its own
            return {}
        pending = self._pending
        also = {self._source.canary_name: pending["adapter"]} if pending is not None else {}
        try:
            return self._replicas.reconcile(self.store.latest_policies().get(self.served_name), also=also)
        except PublishError as exc:
            report_failure("replica_reconcile_failures", exc, message=(
                f"lightning-rl: a replica could not be reconciled with the live version of {self.served_name!r}: "
                f"{exc}; tried again at the next check (counted as replica_reconcile_failures, logged once)"))
            return {}

    def _write(self, line: dict[str, Any], batch: StepBatch | None, step: int) -> None:
        if self._metrics is None:
            config = {"served_name": self.served_name, "min_new": self.min_new, "max_policy_lag": self.max_policy_lag,
                      "reward_name": self.reward_name, "credit": self.credit, "level": self.level, "seed": self.seed,
                      "gate_tasks": len(self.gate_tasks), "gate_n": self.gate_n, "gate_margin": self.gate_margin,
                      "gate_confidence": self.gate_confidence, "rollback_watch": self.rollback_watch,
                      "watch_min_rollouts": self.watch_min_rollouts, "canary": self.canary,
                      "canary_min_rollouts": self.canary_min_rollouts, "canary_timeout": self.canary_timeout,
                      **{f"local.{k}": v for k, v in self.local.scalars().items()}}
            self._metrics = MetricsLog(self.metrics_path, make_loggers(
                self.loggers, self.out_dir, self.run_name or self.out_dir.resolve().name, config))
        self._metrics.write(line, step, sample_rows(batch.groups) if batch is not None else ())

    def _on_check(self, batch: StepBatch | None) -> bool:
        """After every check of the store: the replicas reconciled, the canary, then the rollback watch."""
        self.reconcile()
        if self._judge_canary():
            return False
        return self._watch(batch)

    def _next_version(self) -> int:
        """The update's version (``ProductionStream.next_version``): one past every version this trainer saw
        live, the versions rolled back from included; a store's publishes from other runs do not count."""
        return self._source.next_version

    def run(self, *, interval: float = 10.0, max_updates: int | None = None) -> None:
        """Update whenever enough fresh rollouts wait, checking every ``interval`` seconds."""
        if self._backend is None:
            self.start()
        self._source.interval = interval
        updates = 0
        while max_updates is None or updates < max_updates:
            began = time.perf_counter()
            batch = self._source.next_batch(on_check=self._on_check)
            if batch is None:  # closed
                return
            self._follow_live()
            self._update(batch, began)
            updates += 1
        while self._pending is not None and not self._source.closed:  # the last update's canary
            self._on_check(self._source.poll())
            if self._pending is not None:
                self._source.wait(interval)

    def close(self) -> None:
        if self._pending is not None:  # routing stops now, not at canary_until
            self._end_canary(None, "the trainer stopped before the canary was judged")
        self._source.close()
        if self._gate is not None:
            self._gate.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
