"""Continuous mode's source: ``ProductionStream``, production rollouts trained on as their rewards arrive
(``continuous.py``, ``lightning-rl train continuous``), with its resumable state and its canary bookkeeping."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...boundaries import check_int
from ...diagnostics import report_failure
from ...records import Mode, RolloutStatus, Sample, Trajectory
from ...store.protocols import Store
from ...store.queries import trajectory
from ...store.training_samples import SampleStats, trajectory_samples
from .interface import StepBatch


class ProductionStream:
    """The production stream (continuous mode): prod rollouts, trained on as their rewards arrive.

    Each check (``poll``) reads what is new, never the store's whole history: rollouts rewarded
    (``reward_name``) since the last check (a position in the store's rewards), plus those still running
    when their reward came. Each succeeded one is dated with the policy version that served it (the oldest
    its LLM calls were stamped with; for rollouts recorded without one, the last publish before it
    started), dropped and counted when more than ``max_policy_lag`` versions behind, and otherwise kept
    for its samples the trainer can reproduce: rewarded calls to ``served_name`` sampled at
    ``temperature`` (a call sent without one: the API's default, 1.0) with no top-p, top-k or min-p
    truncation. The others are counted, and a rollout left with none is not waited on. A batch is every
    waiting rollout, once there are at least ``min_new``; each rollout is a group of its own (production
    has no tries of one task to compare: ``batch_baseline``), and ``StepBatch.samples`` holds the samples.

    State (versions published with their times, rollouts used or dropped, the reward position, rollouts
    rewarded while running, those waiting, the batch being trained on) is saved to ``state_path`` at every
    check and publish, so a restarted trainer resumes where it stopped, and a trainer stopped between its
    publish and the state's save neither goes back a version nor trains twice on one batch. Rollouts used
    or dropped are remembered only while they could still be trained on (served at most
    ``max_policy_lag`` versions ago): the state stays bounded however long the stream runs, and an older
    rollout rewarded again is too stale anyway (dropped and counted).

    A canary (``continuous.py``): rollouts whose calls went to the candidate's name (``canary_name``) are
    never trained on (counted as ``canary``); while ``canary`` is set (the candidate's version and when
    its canary began), the rewards of those begun since go to ``canary_rewards``, and those of the live
    version's rollouts begun since to ``canary_live``: the two samples the canary's test compares, drawn
    over the same minutes of traffic. While ``hold`` is set, no batch is taken (the rollouts wait)."""

    def __init__(self, store: Store, *, state_path: str | Path, served_name: str = "policy", min_new: int = 32,
                 max_policy_lag: int = 2, reward_name: str = "reward", credit: str = "final", level: str = "call",
                 agents: Any = None, temperature: float = 1.0, interval: float = 10.0) -> None:
        check_int(min_new, "min_new", minimum=1, meaning="fresh rollouts per update")
        check_int(max_policy_lag, "max_policy_lag", meaning="versions a rollout may be behind")
        self.store, self.served_name, self.min_new, self.max_policy_lag = store, served_name, min_new, max_policy_lag
        self.reward_name, self.credit, self.level, self.agents = reward_name, credit, level, agents
        self.temperature, self.interval = temperature, interval
        self.state_path = Path(state_path)
        self.state = self._load()
        self.waiting: dict[str, Trajectory] = {}  # fresh, rewarded, not yet trained on
        # production reward by the version that served it (rollout id -> its latest final reward), for the
        # last few versions published; in memory only (the rollback watch, continuous.py)
        self.rewards_by_version: dict[int, dict[str, float]] = {}
        self.last_check: dict[str, int] = {}
        self.canary_name = f"{served_name}-candidate"
        self.canary: tuple[int, float] | None = None  # (candidate version, when its canary began)
        self.canary_rewards: dict[str, float] = {}
        self.canary_live: dict[str, float] = {}
        self.hold = False
        self._closed = threading.Event()
        self._reset_counts()

    # -- state ---------------------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        state: dict[str, Any] = {"published": [], "used": {}, "dropped": {}, "reward_position": 0, "pending": [],
                                 "waiting": [], "taking": [], "taking_versions": {}}
        if self.state_path.exists():
            state.update(json.loads(self.state_path.read_text()))
            last = state["published"][-1][0] if state["published"] else 0
            for key in ("used", "dropped"):  # files from before the bound held lists of ids
                if isinstance(state[key], list):
                    state[key] = dict.fromkeys(state[key], last)
        return state

    def _save(self) -> None:
        oldest = self.version - self.max_policy_lag  # rollouts served before it can no longer be trained on
        for key in ("used", "dropped"):
            self.state[key] = {rid: v for rid, v in self.state[key].items() if v >= oldest}
        # publish times date rollouts recorded without a version: one started before these is stale anyway
        self.state["published"] = [p for p in self.state["published"] if p[0] >= oldest - 1]
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.state_path)

    @property
    def version(self) -> int:
        """The last version published (-1 before the first)."""
        return self.state["published"][-1][0] if self.state["published"] else -1

    @property
    def next_version(self) -> int:
        """The version the next update publishes: one past every version this stream saw live (after a
        rollback, past the versions rolled back from too; a refused candidate takes none)."""
        return max((v for v, _ in self.state["published"]), default=-1) + 1

    def served_version(self, traj: Trajectory) -> int:
        """The policy version that served ``traj`` (class doc)."""
        if traj.policy_version is not None:
            return traj.policy_version
        before = [v for v, t in self.state["published"] if t <= traj.start_time]
        return before[-1] if before else 0

    # -- the interface -------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume: finish a publish the last run did not save, and read back the waiting rollouts."""
        if self.state["taking"]:
            records = self.store.policies(self.served_name)
            if records and records[-1].version == self.next_version:  # published, then stopped before saving
                for rid in self.state["taking"]:
                    self.state["used"][rid] = self.state.get("taking_versions", {}).get(rid, self.version)
                self.state["published"].append([records[-1].version, records[-1].time])
            else:  # stopped before its publish: the batch was never trained on for good
                self.state["waiting"] = list(dict.fromkeys([*self.state["taking"], *self.state["waiting"]]))
            self.state["taking"], self.state["taking_versions"] = [], {}
            self._save()
        for rid in self.state["waiting"]:
            self.waiting[rid] = trajectory(self.store, rid, credit=self.credit, reward_name=self.reward_name)

    def next_batch(self, on_check: Callable[[StepBatch | None], bool] | None = None) -> StepBatch | None:
        """The next batch, checking every ``interval`` seconds; None once closed. ``on_check(batch)`` runs
        after every check; when it returns False, the batch (if any) is not handed out."""
        while not self._closed.is_set():
            batch = self.poll()
            if on_check is not None and not on_check(batch):
                batch = None
            if batch is not None:
                return batch
            self._closed.wait(self.interval)
        return None

    def published(self, updates: int) -> None:
        """Version ``updates`` is live: the batch taken for it is used."""
        versions = self.state.get("taking_versions", {})
        for rid in self.state["taking"]:
            self.state["used"][rid] = versions.get(rid, updates)
        if not self.state["published"] or self.state["published"][-1][0] != updates:
            self.state["published"].append([updates, time.time()])
        recent = {v for v, _ in self.state["published"][-4:]}
        self.rewards_by_version = {v: r for v, r in self.rewards_by_version.items() if v in recent or v > updates}
        self.state["taking"], self.state["taking_versions"] = [], {}
        self._save()

    def discarded(self) -> None:
        """The batch taken was trained on, but its version did not go live (the gate refused it): its
        rollouts are used all the same, and the live version is unchanged."""
        versions = self.state.get("taking_versions", {})
        for rid in self.state["taking"]:
            self.state["used"][rid] = versions.get(rid, self.version)
        self.state["taking"], self.state["taking_versions"] = [], {}
        self._save()

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until closed; returns whether it is closed."""
        return self._closed.wait(seconds)

    # -- checks --------------------------------------------------------------------------------------
    def _reset_counts(self) -> None:
        self._dropped_since_batch = 0
        # samples of rollouts not kept since the last batch: other model, other sampling, and SampleStats
        self._skipped_since_batch = {"other_model": 0, "other_sampling": 0}
        self._stats_since_batch = SampleStats()

    def poll(self) -> StepBatch | None:
        """One check of the store (class doc): a batch when ``min_new`` rollouts wait, else None."""
        ids, position = self.store.rewarded_since(self.state["reward_position"], name=self.reward_name)
        pending: list[str] = []
        dropped = assembled = 0
        # rollouts left with no sample to train on (without_samples), and those of them that lost samples for
        # calling another model or sampling otherwise
        rejected = {"without_samples": 0, "other_model": 0, "other_sampling": 0, "canary": 0}
        for rid in dict.fromkeys([*self.state["pending"], *ids]):
            # A waiting rollout rewarded again is read again (its reward changed); a used one is not.
            if rid in self.state["used"] or rid in self.state["dropped"] or rid in self.state["taking"]:
                continue
            rollout = self.store.get_rollout(rid)
            if rollout.mode != Mode.PROD:
                continue
            if rollout.status == RolloutStatus.RUNNING:
                pending.append(rid)  # rewarded mid-run: look again when it has ended
                continue
            if rollout.status != RolloutStatus.SUCCEEDED:
                continue
            traj = trajectory(self.store, rid, credit=self.credit, reward_name=self.reward_name)
            assembled += 1
            if traj.final_reward is None:
                continue
            served = self.served_version(traj)
            began = self.canary is not None and traj.start_time >= self.canary[1]
            on_canary = [c.policy_version for c in traj.llm_calls if c.model == self.canary_name]
            if on_canary:  # served by a candidate on canary (its calls carry the candidate's version)
                if began and self.canary[0] in on_canary:
                    self.canary_rewards[rid] = traj.final_reward
                self.state["used"][rid] = max(served, self.version)
                rejected["canary"] += 1
                continue
            if began and served == self.version:
                self.canary_live[rid] = traj.final_reward
            self.rewards_by_version.setdefault(served, {})[rid] = traj.final_reward
            if self.version - served > self.max_policy_lag or served > self.version:  # > : served by a version
                # that was rolled back (lightning-rl policies rollback): not the policy training goes on from
                self.state["dropped"][rid] = served
                dropped += 1
                continue
            kept, stats, skipped = self.trainable(traj)
            if kept:
                self.waiting[rid] = traj
                continue
            self._stats_since_batch.add(stats)  # nothing to train on: counted, never waiting
            rejected["without_samples"] += 1
            for why, n in skipped.items():
                self._skipped_since_batch[why] += n
                rejected[why] += bool(n)
        self.state.update(reward_position=position, pending=pending, waiting=list(self.waiting))
        self._save()
        self.last_check = {"rewarded_new": len(ids), "assembled": assembled, "pending": len(pending),
                           "waiting": len(self.waiting), "dropped_stale": dropped, **rejected}
        if rejected["other_model"] or rejected["other_sampling"]:
            self._warn_skipped(rejected)
        self._dropped_since_batch += dropped
        if len(self.waiting) < self.min_new or self.hold:
            return None
        return self._take()

    def _take(self) -> StepBatch | None:
        fresh = list(self.waiting.values())
        samples: list[Sample] = []
        stats = SampleStats()
        stats.add(self._stats_since_batch)
        skipped = dict(self._skipped_since_batch)
        for traj in fresh:
            kept, s, why = self.trainable(traj)
            stats.add(s)
            samples += kept
            for key, n in why.items():
                skipped[key] += n
        if not samples:  # waiting rollouts read back by a trainer started with other settings (agents, level)
            return None
        ids = [t.rollout_id for t in fresh]
        self.waiting.clear()
        self.state.update(waiting=[], taking=ids,
                          taking_versions={t.rollout_id: self.served_version(t) for t in fresh})
        self._save()
        batch = StepBatch(ids, [[t] for t in fresh], {str(RolloutStatus.SUCCEEDED): len(fresh)}, metrics={
            "rollouts": len(fresh), "dropped_stale": self._dropped_since_batch,
            "prefix_splits": stats.splits, "calls_without_engine_ids": stats.missing_token_ids,
            "unrewarded_samples": stats.skipped_unrewarded, "skipped_other_model": skipped["other_model"],
            "skipped_other_sampling": skipped["other_sampling"],
            "train_reward": sum(t.final_reward for t in fresh) / len(fresh)}, samples=samples)
        self._reset_counts()
        return batch

    def _reproducible(self, sampling: dict[str, Any]) -> bool:
        """Whether a call sampled with ``sampling`` (its recorded request parameters) drew its tokens
        from the distribution the trainer computes: softmax(logits / temperature), untruncated."""
        temperature = sampling.get("temperature")
        temperature = 1.0 if temperature is None else temperature  # not sent: the API's default
        if not isinstance(temperature, (int, float)) or abs(temperature - self.temperature) > 1e-6:
            return False
        top_p, top_k, min_p = sampling.get("top_p"), sampling.get("top_k"), sampling.get("min_p")
        return (top_p is None or top_p >= 1) and top_k in (None, 0, -1) and not min_p

    def trainable(self, traj: Trajectory) -> tuple[list[Sample], SampleStats, dict[str, int]]:
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
                f"temperature than the trainer's ({self.temperature}), or with top-p/top-k/min-p; the trainer "
                "computes log-probs at its temperature, untruncated, so they are not trained on. Give the trainer "
                "the agents' temperature (--temperature) (logged once)"))
        if rejected["other_model"]:
            report_failure("continuous: production calls to another model", message=(
                f"lightning-rl: {rejected['other_model']} rewarded production rollout(s) called only models other "
                f"than {self.served_name!r} (the trained LoRA); they are not trained on (logged once)"))
