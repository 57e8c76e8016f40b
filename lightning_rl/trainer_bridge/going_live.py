"""How the continuous trainer (``continuous.py``) goes live: the gate, the canary, the rollback watch, and a
rollback made by hand. ``GoingLive`` is a base of ``ContinuousTrainer``: its methods read the trainer's
settings and state (``store``, ``served_name``, ``_source``, ``_backend``, ``_pending``, ``_watching``, ...)
and call back its ``_publish`` and ``_write``.

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
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ..diagnostics import report_failure
from ..tracer.provider import tracing
from .local import load_adapter
from .noninferiority import not_worse
from .publishers import load_served
from .rollback import rollback
from .sources import StepBatch

log = logging.getLogger(__package__ + ".continuous")  # the trainer's logger: one name for all its lines


class GoingLive:
    """The going-live decisions of ``ContinuousTrainer`` (module doc); not used alone."""

    # -- the gate ------------------------------------------------------------------------------------
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

    # -- the canary ----------------------------------------------------------------------------------
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

    # -- the live version: the store's latest publish, and the rollback watch ------------------------
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
