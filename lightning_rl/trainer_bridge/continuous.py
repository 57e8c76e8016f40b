"""Continuous training from production traffic (``lightning-rl train continuous``).

Production agents run with ``mode="prod"``; rewards arrive during the rollout or long after it
(``store.add_reward`` user feedback). The trainer reads them through the production stream
(``sources.ProductionStream``, the sample-source interface that ``Trainer.fit`` uses for task sets and
replays): each check reads what is new; rollouts more than ``max_policy_lag`` versions behind are
dropped and counted; only the calls the trainer can reproduce (to ``served_name``, at
``local.temperature``, untruncated) are trained on. When at least ``min_new`` fresh rollouts wait,
``step()`` updates with an estimator that needs no groups (``batch_baseline`` by default) and publishes
the next version; ``run()`` does it without end.

With ``gate_tasks`` and ``gate_agent``, an update is a *candidate*: saved under
``out_dir/candidates/``, evaluated by the gate (``gate.py``, ``noninferiority.py``) beside the live
policy, and published only when not worse; a refused candidate stays on disk, its batch counts as used,
and training goes on from the live policy's weights (reloaded into the local model). The gate's figures
and decision are in the log and the metrics line (``gate_*``).

With ``canary`` (a share, e.g. 0.1), a candidate (the gate's promoted one, when there is a gate) is
then loaded into the engine under ``<served_name>-candidate`` and a ``canary`` decision is recorded: every
process's ``@trace`` (and the gateway) sends that share of production rollouts to it (``tracer/canary.py``).
No batch is taken meanwhile. Once ``canary_min_rollouts`` of its rollouts are rewarded, their rewards are
tested against the live version's rollouts begun over the same time (the gate's test); the candidate is
published when not worse, else refused (as the gate refuses). Without enough rewarded canary rollouts in
``canary_timeout`` seconds it is refused: no evidence, no promotion. The update's metrics line is written
when the canary ends, with its figures (``canary_*``). Canary rollouts are never trained on. A trainer
started again finds the canary its last run left and ends it (refused, with the reason).

A rollback (``lightning-rl policies rollback``, ``rollback.py``) publishes an earlier version again; the
trainer sees that latest publish at its next step (``step``: before reading the store; ``run``: when a
batch is ready, before updating) and goes on from those weights: production rollouts served by a version
rolled back from are then dropped as stale, and the next candidate's version is one past every version
the trainer saw live (``ProductionStream.next_version``).

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
from ..tracer.provider import tracing
from .config import ConfigModel, Count, Credit, Flag, LocalConfig, Loggers, Name, NonNegativeInt, Positive
from .gate import Gate
from .local import LocalBackend, load_adapter
from .loggers import MetricsLog, make_loggers, sample_rows
from .noninferiority import not_worse
from .publishers import Publisher, load_served, make_publisher, publish_and_record
from .replicas import Replicas
from .rollback import rollback
from .sources import ProductionStream, StepBatch

log = logging.getLogger(__name__)
Fraction = Annotated[float, Field(strict=True, ge=0.5, lt=1.0)]
Share = Annotated[float, Field(strict=True, ge=0.0, lt=1.0)]


class ContinuousTrainer(ConfigModel):
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
    gate_tasks: Sequence[Any] = Field((), repr=False)  # the gate before going live (module doc); () : none
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

    # -- the canary ---------------------------------------------------------------------------------
    def _start_canary(self, version: int, batch: StepBatch, gate: dict[str, Any], metrics: dict[str, Any],
                      began: float, read: float, trained: float) -> None:
        """Serve the candidate under its own name to ``canary`` of production (module doc)."""
        path = gate.get("candidate_adapter") or str(self._save_candidate(version))
        name = self._source.canary_name
        load_served(self._replicas, name, path)
        started = time.time()
        until = started + self.canary_timeout + 60.0  # processes stop routing by then, whatever happens here
        self.store.record_decision(self.served_name, version, "canary", live_version=self.version, adapter=path,
                                   figures={"canary_name": name, "canary_share": self.canary,
                                            "canary_until": until, "canary_min_rollouts": self.canary_min_rollouts},
                                   reason=f"{self.canary:.0%} of production to {name!r}")
        log.warning("lightning-rl canary: candidate v%d serves %.0f%% of production as %r against live v%d",
                    version, 100 * self.canary, name, self.version)
        self._source.canary, self._source.hold = (version, started), True
        self._source.canary_rewards, self._source.canary_live = {}, {}
        line = {"version": self.version, **gate, **batch.metrics, **metrics, "read_seconds": read - began,
                "update_seconds": trained - read - gate.get("gate_seconds", 0.0), "candidate_version": version,
                "candidate_adapter": path, "live_version": self.version}
        self._pending = {"line": line, "batch": batch, "version": version, "adapter": path, "started": started}

    def _save_candidate(self, version: int) -> Path:
        folder = self.out_dir / "candidates"
        tries = len(list(folder.glob(f"v{version:05d}.*"))) if folder.is_dir() else 0
        path = (folder / f"v{version:05d}.{tries + 1}").resolve()
        self._backend.adapter().save_pretrained(str(path))
        return path

    def _judge_canary(self) -> bool:
        """After a check of the store: end the canary when its rollouts are rewarded enough, or when its
        time is out. Returns True while it goes on (no batch is taken)."""
        pending = self._pending
        if pending is None:
            return False
        latest = self.store.latest_decisions().get(self.served_name)
        if latest is None or latest.decision != "canary" or latest.version != pending["version"]:  # an operator's
            what = "no" if latest is None else f"a {latest.decision.value}"  # rollback, or another trainer's decision
            return self._end_canary(None, f"{what} decision about {self.served_name!r} was recorded during the canary")
        candidate = list(self._source.canary_rewards.values())
        live = list(self._source.canary_live.values())
        waited = time.time() - pending["started"]
        if len(candidate) < self.canary_min_rollouts or len(live) < 2:
            if waited < self.canary_timeout:
                return True
            return self._end_canary(None, f"only {len(candidate)} rewarded canary rollout(s) (of "
                                          f"{self.canary_min_rollouts}) and {len(live)} live one(s) in {waited:.0f}s; "
                                          "no evidence, no promotion")
        test = not_worse(candidate, live, margin=self.gate_margin, confidence=self.gate_confidence)
        return self._end_canary(test, None)

    def _end_canary(self, test: Any, short: str | None) -> bool:
        pending, self._pending = self._pending, None
        version, line = pending["version"], pending["line"]
        self._source.canary, self._source.hold = None, False
        promoted = test is not None and test.not_worse
        figures = {f"canary_{k}": v for k, v in test.figures().items()} if test is not None else {}
        figures.update({"canary_share": self.canary, "canary_seconds": time.time() - pending["started"]})
        if test is None:
            reason = f"refused: {short}"
        else:
            reason = (f"canary: production reward {test.mean_candidate:.4f} (n={test.n_candidate}) against "
                      f"{test.mean_live:.4f} (n={test.n_live}) of the live version; lower bound "
                      f"{test.lower_bound:.4f} {'>=' if promoted else '<'} -margin {-test.margin:.4f}")
        log.warning("lightning-rl canary: candidate v%d %s: %s", version, "promoted" if promoted else "refused", reason)
        live = self.version
        began = time.perf_counter()
        if promoted and (failed := self._publish(version)) is not None:
            promoted, reason = False, f"refused: the publish failed: {failed}"
        elif promoted:
            self._watching = (version, live) if self.rollback_watch else None
        else:
            self._source.discarded()
            load_adapter(self._backend, self._live_adapter)
        self.store.record_decision(self.served_name, version, "promoted" if promoted else "refused", live_version=live,
                                   adapter=pending["adapter"], figures={k: v for k, v in line.items()
                                                                        if k.startswith("gate_")} | figures,
                                   reason=reason)
        line.update(figures, version=self.version, canary_decision="promoted" if promoted else "refused",
                    canary_promoted=int(promoted), publish_seconds=time.perf_counter() - began, time=time.time())
        self._write(line, pending["batch"], version)
        return False

    def _end_stranded_canary(self) -> None:
        """A canary a previous run of this served name left (it stopped mid-canary): ended, refused."""
        latest = self.store.latest_decisions().get(self.served_name) if hasattr(self.store, "latest_decisions") else None
        if latest is None or latest.decision != "canary":
            return
        self.store.record_decision(self.served_name, latest.version, "refused", live_version=self.version,
                                   adapter=latest.adapter, reason="the trainer stopped during the candidate's canary; "
                                   "a trainer started again ended it")
        log.warning("lightning-rl canary: ended the canary of candidate v%d a previous run left", latest.version)

    def _on_check(self, batch: StepBatch | None) -> bool:
        """After every check of the store: the replicas reconciled, the canary, then the rollback watch."""
        self.reconcile()
        if self._judge_canary():
            return False
        return self._watch(batch)

    def _follow_live(self, figures: dict[str, Any] | None = None) -> None:
        """Adopt the store's latest publish of ``served_name`` when it is not this trainer's version (a
        rollback): its weights into the local model, its version as the live one; a metrics line says so
        (``rolled_back``, ``rolled_back_from``, and the watch's ``figures`` when the watch did it)."""
        latest = self.store.latest_policies().get(self.served_name)
        if latest is None or latest.version == self.version or self.version < 0:
            return
        if latest.adapter is None or not (Path(latest.adapter) / "adapter_config.json").is_file():
            report_failure("continuous: the live version's adapter is missing", message=(
                f"lightning-rl: {self.served_name!r} was published as version {latest.version} with no adapter "
                f"folder at {latest.adapter!r}; the trainer goes on from version {self.version} (logged once)"))
            return
        if self._pending is not None:  # the candidate on canary was trained from the version rolled back from
            self._end_canary(None, f"version {latest.version} was made live while the candidate was on canary")
        load_adapter(self._backend, latest.adapter)
        log.warning("lightning-rl: %r is at version %d in the store (a rollback from %d); training goes on from it",
                    self.served_name, latest.version, self.version)
        self._live_adapter = latest.adapter
        old = self.version
        self._source.published(latest.version)
        tracing.set_policy_version(latest.version, model=self.served_name,  # this process's calls, as a publish does
                                   served_as=getattr(latest, "served_as", None))
        self._write({"version": latest.version, "rolled_back": 1, "rolled_back_from": old, **(figures or {}),
                     "time": time.time()}, None, old)

    def _watch(self, batch: StepBatch | None) -> bool:
        """The rollback watch, after every check of the store: once the version published last has
        ``watch_min_rollouts`` rewarded production rollouts, its reward is tested against the version it
        replaced (``noninferiority``: the same test as the gate, from above); worse by more than the margin
        at ``gate_confidence``: the replaced version is restored (``rollback``, recorded with the figures)
        and training goes on from it. Returns False when it rolled back (the batch taken is dropped: its
        rollouts were served by the version rolled back from)."""
        if self._watching is None:
            return True
        new, old = self._watching
        if self.version != new:  # rolled back by hand meanwhile
            self._watching = None
            return True
        got = self._source.rewards_by_version
        fresh, before = list(got.get(new, {}).values()), list(got.get(old, {}).values())
        if len(fresh) < self.watch_min_rollouts or len(before) < 2:
            return True
        test = not_worse(fresh, before, margin=self.gate_margin, confidence=self.gate_confidence)
        if not test.worse:
            return True
        figures = {f"watch_{k}": v for k, v in test.figures().items()}
        reason = (f"watch: production reward of version {new} {test.mean_candidate:.4f} (n={test.n_candidate}) against "
                  f"{test.mean_live:.4f} (n={test.n_live}) of version {old}; upper bound {test.upper_bound:.4f} < "
                  f"-margin {-test.margin:.4f}")
        rollback(self.store, to=old, server_url=self._replicas, served_name=self.served_name, reason=reason,
                 figures=figures)
        log.warning("lightning-rl: rolled %r back to version %d: %s", self.served_name, old, reason)
        self._watching = None
        if batch is not None:
            self._source.discarded()
        self._follow_live(figures)
        return False

    def _next_version(self) -> int:
        """The update's version (``ProductionStream.next_version``): one past every version this trainer saw
        live, the versions rolled back from included; a store's publishes from other runs do not count."""
        return self._source.next_version

    def _judge(self, version: int) -> dict[str, Any]:
        """Save the candidate, run the gate, log its figures; returns them (``gate_*``) with the decision."""
        path = self._save_candidate(version)
        test = self._gate.check(str(path), self.version)
        decision = "promoted" if test.not_worse else "refused"
        figures = {f"gate_{k}": v for k, v in test.figures().items()}
        self.store.record_decision(self.served_name, version, "evaluated", live_version=self.version, adapter=str(path),
                                   figures=figures)
        log.warning("lightning-rl gate: candidate v%d %s against live v%d: n=%d/%d, mean %.4f vs %.4f, difference "
                    "%.4f, lower bound %.4f at %.0f%% (margin %.4f)", version, decision, self.version,
                    test.n_candidate, test.n_live, test.mean_candidate, test.mean_live, test.difference,
                    test.lower_bound, 100 * test.confidence, test.margin)
        return {"gate_decision": decision, "gate_promoted": int(test.not_worse), "candidate_version": version,
                "candidate_adapter": str(path), "live_version": self.version, **figures}

    def _record(self, gate: dict[str, Any], decision: str, live_version: int) -> None:
        """The gate's decision as a store record, with its figures, beside the publishes."""
        figures = {k: v for k, v in gate.items() if k.startswith("gate_") and k != "gate_decision"}
        bound, margin = gate["gate_lower_bound"], gate["gate_margin"]
        reason = f"lower bound {bound:.4f} {'>=' if decision == 'promoted' else '<'} -margin {-margin:.4f}"
        self.store.record_decision(self.served_name, gate["candidate_version"], decision, live_version=live_version,
                                   adapter=gate["candidate_adapter"], figures=figures, reason=reason)

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
