"""``Trainer.fit``: the training loop over a task set, on the same mechanism as production.

Each step: sample ``tasks_per_step`` tasks, queue each ``n`` times (one group), let runners execute
the traced agent against the served model, build samples from those groups, update the policy,
publish the new weights (policy version = step + 1), and append a metrics line to
``metrics.jsonl``. Succeeded rollouts are trained on with their rewards; rollouts the model made fail
with ``failure_reward``; a group with an infrastructure failure is left out whole
(``trainer_bridge/failures.py``). Everything left out is counted in the line. Optional held-out
evaluation before and after (``mode="eval"``). ``plot_metrics`` draws reward against step.

Where the batches come from is a sample source (``sources.py``): by default the task set, run live,
synchronously or overlapped. ``overlap=True, max_staleness=k``: the runner keeps taking tasks while
the trainer updates, a batch is the first ``tasks_per_step`` groups to complete, and new weights go
live while rollouts are in flight; each sample carries the policy version its call was served by
(the span's), and samples more than k versions behind the policy being updated are dropped and
counted (``samples_dropped_stale``; ``staleness``: a histogram of versions behind). ``max_staleness=0``
is the synchronous loop, by the same code. ``source=StoredGroups(store)`` replays a run already in a
store (nothing runs; ``lightning-rl train --replay``). Every publish records the groups it was
trained on (``PolicyRecord.trained_on``).

Teams: ``policies={"planner": "planner-lora", "solver": "solver-lora"}`` maps each agent to the served
name of its own LoRA on the one base model (two agents may share one). Each policy is an adapter of
the local backend, published and versioned on its own; a step routes samples by the served name
their calls went to (``route_by_policy``), updates each policy that has samples and publishes it.
Without ``policies``, every agent trains the one policy served as ``served_name``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..diagnostics import counters
from ..errors import ConfigurationError, UnknownNameError
from ..records import RolloutStatus, Sample
from ..store.base import Store
from ..store.samples import SampleStats, route_by_policy, trajectory_samples
from .failures import INFRA_ERRORS, FailureCounts, failure_kind, with_failure_reward
from .local import LocalBackend, LocalConfig, load_adapter
from .loggers import MetricsLog, check_loggers, make_loggers, sample_rows
from .publishers import Publisher, check_served, make_publisher, publish_and_record
from .runner import LoopThread, Runner, run_in_processes
from .sources import LiveGroups, SampleSource, StepBatch, read_groups

BACKENDS = ("local",)


#: This process's counters of records set aside, put on every metrics line (cumulative): a record the store
#: quarantined, ops the store server refused, stored spans or rows the readers could not use, LLM calls
#: seen at the HTTP layer that bypassed the instrumented client.
SET_ASIDE = ("records_quarantined", "rejected_ops", "malformed_spans_skipped", "malformed_span_fields",
             "span_rows_unreadable", "rollout_rows_unreadable", "llm_calls_bypassing_capture")


def set_aside_counts() -> dict[str, int]:
    found = counters()
    return {name: found.get(name, 0) for name in SET_ASIDE}


@dataclass
class TrainResult:
    history: list[dict[str, Any]]
    metrics_path: Path
    plot_path: Path | None
    eval_before: float | None = None
    eval_after: float | None = None


@dataclass
class Trainer:
    agent: Callable[[Any], Any] | None  # None only with source= (a replay runs no agent)
    tasks: Sequence[Any]
    store: Store
    model_dir: str | Path
    server_url: str | None  # None only with source=: adapters are saved, not served
    backend: str = "local"
    served_name: str = "policy"
    out_dir: str | Path = ".cache/train"
    n: int = 8
    tasks_per_step: int = 8
    steps: int = 20
    eval_tasks: Sequence[Any] = ()
    eval_agent: Callable[[Any], Any] | None = None
    eval_n: int = 1
    concurrency: int = 16
    level: str = "call"
    credit: str = "final"
    agents: str | Sequence[str] | None = None
    policies: Mapping[str, str] | None = None  # agent name -> served name of its LoRA (None: one policy)
    local: LocalConfig = field(default_factory=LocalConfig)
    seed: int = 0
    lease_seconds: float = 60.0
    rollout_timeout: float | None = 120.0
    progress: bool = True
    publisher: Publisher | None = None
    processes: int = 0  # > 0: sync agents run in this many worker processes (SQLite store, importable agent)
    failure_reward: float = 0.0  # the reward of a rollout the model made fail (it is trained on)
    infra_errors: frozenset[str] = INFRA_ERRORS  # error types that are not the model's: their group is dropped
    overlap: bool = False  # rollouts go on while the trainer updates (bounded by max_staleness)
    max_staleness: int | None = None  # versions a sample may be behind (None: 1 with overlap, else 0)
    source: SampleSource | None = None  # None: the task set, run live (sources.LiveGroups)
    loggers: Sequence[Any] = ()  # experiment trackers beside metrics.jsonl: "tensorboard", "mlflow", "wandb" (loggers.py)
    run_name: str | None = None  # the trackers' run name (default: the out_dir's name)
    init_adapter: str | Path | Mapping[str, str | Path] | None = None  # start from this LoRA (Trainer.sft sets it)
    judge: Any = None  # a GroupJudge: rewards the tries a task set leaves unrewarded (lightning_rl.judge)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UnknownNameError(
                f"unknown backend {self.backend!r}; known: {', '.join(BACKENDS)} (verl comes with the verl bridge)"
            )
        if self.source is None:
            if not callable(self.agent):
                raise ConfigurationError(f"Trainer needs the agent to run (a traced function), got {self.agent!r}; "
                                         "only a replay (source=StoredGroups(store)) runs none")
            if not self.tasks:
                raise ConfigurationError("Trainer needs at least one task")
            if not self.server_url:
                raise ConfigurationError("Trainer needs server_url, the vLLM server its agent calls and its new "
                                         "weights are loaded into (only a replay, source=, trains without one)")
        self.max_staleness = self._check_staleness()
        check_loggers(self.loggers)
        if self.n < 2 and self.local.adv_estimator == "grpo":
            raise ConfigurationError(
                f"GRPO compares the tries of a task, so it needs n >= 2 (got n={self.n}); raise n, or use "
                "LocalConfig(adv_estimator='batch_baseline')")
        self._served = self._check_policies()
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self._rng = random.Random(self.seed)
        self._runners: dict[int, Runner] = {}
        # One event loop for every runner of this trainer (evaluation and training): async clients
        # such as AsyncOpenAI's connection pool are bound to the loop they first ran on.
        self._loop: LoopThread | None = None

    def _check_staleness(self) -> int:
        k = self.max_staleness
        if k is None:
            return 1 if self.overlap else 0
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigurationError(f"max_staleness must be an int >= 0 (versions a sample may be behind), got {k!r}")
        if k and not self.overlap and self.source is None:
            raise ConfigurationError(f"max_staleness={k} lets samples be {k} version(s) behind, which happens only "
                                     "when rollouts overlap updates: set overlap=True, or max_staleness=0")
        return k

    def _check_policies(self) -> list[str]:
        """The served names trained, in order; with ``policies``, the agents to train default to its keys."""
        if self.policies is None:
            return [self.served_name]
        example = 'policies={"planner": "planner-lora", "solver": "solver-lora"}'
        if not isinstance(self.policies, Mapping) or not self.policies:
            raise ConfigurationError(f"policies must map agent names to served model names, e.g. {example}; "
                                     f"got {self.policies!r}")
        for agent, served in self.policies.items():
            if not isinstance(agent, str) or not agent or not isinstance(served, str) or not served:
                raise ConfigurationError(f"policies entry {agent!r}: {served!r} is not agent name -> served name "
                                         f"(both non-empty strings), e.g. {example}")
        if self.publisher is not None:
            raise ConfigurationError("publisher= publishes one served name; with policies= the trainer makes one "
                                     "vllm_lora publisher per served name (drop publisher=)")
        if self.agents is None:
            self.agents = list(self.policies)
        elif isinstance(self.agents, str):
            raise ConfigurationError(f"with policies=, agents must list agent names, got the pattern {self.agents!r}")
        else:
            missing = [a for a in self.agents if a not in self.policies]
            if missing:
                raise ConfigurationError(f"agent(s) {missing} have no policy; add them to policies= (agent -> served "
                                         f"name; agents may share one) or leave them out of agents=")
        return list(dict.fromkeys(self.policies.values()))

    # -- rollouts -----------------------------------------------------------------------------------
    def _in_processes(self, agent: Callable[[Any], Any]) -> bool:
        return bool(self.processes) and not inspect.iscoroutinefunction(agent)

    def _run_in_processes(self, agent: Callable[[Any], Any], groups: list[str]) -> None:
        codes = run_in_processes(self.store.url, agent, groups, processes=self.processes,
                                 lease_seconds=self.lease_seconds, rollout_timeout=self.rollout_timeout)
        if any(codes):
            raise RuntimeError(f"worker processes exited with {codes}; see their output above")
        self.store.flush()

    def _runner(self, agent: Callable[[Any], Any]) -> Runner:
        """One runner per agent for the whole run, all on the trainer's one event loop (a thread)."""
        runner = self._runners.get(id(agent))
        if runner is None:
            if self._loop is None:
                self._loop = LoopThread()
            runner = self._runners[id(agent)] = Runner(
                self.store, agent, concurrency=self.concurrency, lease_seconds=self.lease_seconds,
                rollout_timeout=self.rollout_timeout, loop=self._loop)
        return runner

    def _run_groups(self, agent: Callable[[Any], Any], tasks: Sequence[Any], n: int, mode: str, desc: str) -> list[str]:
        groups = [self.store.enqueue(task, n=n, mode=mode)[0].group_id for task in tasks]
        if self._in_processes(agent):
            self._run_in_processes(agent, groups)
            return groups
        bar = _bar(len(tasks) * n, desc, self.progress)
        self._runner(agent).run_until_done(groups, on_done=lambda entry, outcome: bar.update(1))
        bar.close()
        return groups

    def live_source(self) -> LiveGroups:
        """The task set, run by this trainer's runner (``fit``'s source unless ``source=`` is given)."""
        common = dict(n=self.n, tasks_per_step=self.tasks_per_step, steps=self.steps,
                      max_staleness=self.max_staleness, credit=self.credit, rng=self._rng)
        if self._in_processes(self.agent):
            return LiveGroups(self.store, self.tasks, run_now=lambda groups: self._run_in_processes(self.agent, groups),
                              **common)
        runner = self._runner(self.agent)
        return LiveGroups(self.store, self.tasks, work=lambda: self._loop.submit(runner.work()), stop=runner.stop,
                          **common)

    def _outcomes(self, groups: Sequence[str]) -> tuple[list[str], dict[str, int]]:
        entries = self.store.queue_entries(groups)
        counts: dict[str, int] = {}
        for e in entries:
            counts[str(e.outcome)] = counts.get(str(e.outcome), 0) + 1
        return [e.rollout_id for e in entries if e.outcome == RolloutStatus.SUCCEEDED], counts

    def step_batch(self, groups: Sequence[str]) -> tuple[list[Sample], list[float], dict[str, Any]]:
        """The samples of these groups in this trainer's store (``batch_samples``)."""
        return self.batch_samples(read_groups(self.store, groups, credit=self.credit))

    def batch_samples(self, batch: StepBatch) -> tuple[list[Sample], list[float], dict[str, Any]]:
        """The samples of a batch's groups (failures handled as the module says), the reward of each
        trained rollout, and the counts for the metrics line: outcomes, failures by kind, groups dropped,
        prefix splits, calls without engine token ids, samples without a reward."""
        failures, stats = FailureCounts(), SampleStats()
        samples: list[Sample] = []
        rewards: list[float] = []
        without_calls = 0
        for trajectories in batch.groups:
            without_calls += sum(1 for t in trajectories if not t.llm_calls)
            kinds = [failure_kind(t, self.infra_errors) for t in trajectories]
            if "infra" in kinds:
                failures.infra_failures += kinds.count("infra")
                failures.groups_dropped += 1
                failures.tries_dropped += len(trajectories)
                continue
            for traj, kind in zip(trajectories, kinds):
                found, s = trajectory_samples(traj, level=self.level, agents=self.agents)
                stats.add(s)
                if kind == "model":
                    failures.model_failures += 1
                    found = with_failure_reward(found, self.failure_reward)
                    rewards.append(self.failure_reward)
                else:
                    rewards.append(traj.final_reward or 0.0)
                for sample in found:
                    if sample.reward is None:
                        stats.skipped_unrewarded += 1
                    else:
                        samples.append(sample)
        counts = {"outcomes": dict(batch.outcomes), **failures.as_metrics(), "prefix_splits": stats.splits,
                  "calls_without_engine_ids": stats.missing_token_ids, "unrewarded_samples": stats.skipped_unrewarded,
                  "rollouts_without_llm_calls": without_calls, **set_aside_counts()}
        return samples, rewards, counts

    def evaluate(self, tasks: Sequence[Any] | None = None, *, n: int | None = None) -> float:
        """Mean final reward of held-out tasks (``mode="eval"``; failed rollouts count as 0)."""
        tasks = list(tasks if tasks is not None else self.eval_tasks)
        groups = self._run_groups(self.eval_agent or self.agent, tasks, n or self.eval_n, "eval", "eval")
        entries = self.store.queue_entries(groups)
        rewards = [self.store.trajectory(e.rollout_id).final_reward or 0.0
                   if e.outcome == RolloutStatus.SUCCEEDED else 0.0 for e in entries]
        return sum(rewards) / max(1, len(rewards))

    # -- the loop -----------------------------------------------------------------------------------
    def drop_stale(self, samples: Sequence[Sample], versions: Mapping[str, int],
                   default_policy: str | None = None) -> tuple[list[Sample], dict[str, Any]]:
        """Samples at most ``max_staleness`` versions behind the policy they train (the version their
        call was served by, from its span, against the policy's version now), and the counts: a
        histogram of versions behind, the samples dropped as too stale, and those whose call carried no
        version or went to a served name this trainer does not publish (kept, not judged). A call that
        named no served model counts as ``default_policy``'s (one policy: the trainer's)."""
        kept: list[Sample] = []
        behind: dict[str, int] = {}
        dropped = unversioned = 0
        for sample in samples:
            policy = sample.policy if sample.policy is not None else default_policy
            current = versions.get(policy) if policy is not None else None
            if current is None or sample.policy_version is None:
                unversioned += 1
                kept.append(sample)
                continue
            lag = current - sample.policy_version
            behind[str(lag)] = behind.get(str(lag), 0) + 1
            if lag > self.max_staleness:
                dropped += 1
            else:
                kept.append(sample)
        return kept, {"staleness": dict(sorted(behind.items(), key=lambda kv: int(kv[0]))),
                      "samples_dropped_stale": dropped, "samples_unversioned": unversioned}

    def _publisher(self, name: str, adapters: Path, team: bool) -> Publisher:
        folder = adapters / name if team else adapters
        if self.publisher is not None:
            return self.publisher
        if self.server_url is None:  # a replay: the adapters are saved, nothing is served
            return make_publisher("adapter_dir", adapter_dir=folder, served_name=name)
        return make_publisher("vllm_lora", server_url=self.server_url, served_name=name, adapter_dir=folder)

    def sft(self, data: Any, *, epochs: int = 2, lr: float | None = None) -> dict[str, Any]:
        """Warm-start the LoRA by supervised fine-tuning on ``data`` (what ``lightning-rl export --format
        chat`` or ``--format tokens`` writes: a path or its lines; ``sft.sft_samples``), with the same PEFT
        setup ``fit`` uses; ``fit`` then starts from it (``init_adapter``; version 0 is the SFT policy).
        With ``policies=`` (a team) each policy is warm-started on its own agents' examples
        (``sft.warm_start``). Returns the SFT's losses and counts, also written to ``out_dir/sft.json``."""
        from .sft import warm_start

        stats, self.init_adapter = warm_start(data, self.model_dir, self.out_dir, local=self.local, seed=self.seed,
                                              epochs=epochs, lr=lr, policies=self.policies)
        return stats

    def _init_adapters(self) -> dict[str | None, Path]:
        """``init_adapter`` as policy -> adapter folder. One policy: the folder. A team: a mapping of served
        names to folders, or a folder with one adapter folder per served name (what ``sft`` writes;
        policies without one start from a fresh LoRA)."""
        if self.init_adapter is None:
            return {}
        if self.policies is None:
            if isinstance(self.init_adapter, Mapping):
                raise ConfigurationError("init_adapter maps policies to adapters, which is for a team (policies=); "
                                         "for one policy give the adapter folder")
            return {None: Path(self.init_adapter)}
        if isinstance(self.init_adapter, Mapping):
            unknown = sorted(set(self.init_adapter) - set(self._served))
            if unknown:
                raise ConfigurationError(f"init_adapter names policies this trainer does not train: {unknown}; its "
                                         f"served names are {self._served}")
            return {name: Path(folder) for name, folder in self.init_adapter.items()}
        folder = Path(self.init_adapter)
        found = {name: folder / name for name in self._served if (folder / name / "adapter_config.json").is_file()}
        if not found:
            raise ConfigurationError(f"init_adapter {str(folder)!r} holds no adapter folder named after a policy "
                                     f"({self._served}); a team's SFT writes sft_adapter/<served name>/")
        return found

    def fit(self) -> TrainResult:
        team = self.policies is not None
        backend = LocalBackend(self.model_dir, self.local, seed=self.seed, policies=self._served if team else None)
        for name, folder in self._init_adapters().items():
            load_adapter(backend, folder, policy=name)
        publishers = {name: self._publisher(name, self.out_dir / "adapters", team) for name in self._served}

        def weights(name: str) -> Any:
            return backend.adapter(name) if team else backend.model

        versions = dict.fromkeys(self._served, 0)
        for name in self._served:
            publish_and_record(publishers[name], self.store, weights(name), 0)
        if team and self.server_url is not None:
            check_served(self.server_url, self._served)
        started = time.time()
        history: list[dict[str, Any]] = []
        result = TrainResult(history, self.metrics_path, None)
        self._metrics = MetricsLog(self.metrics_path, make_loggers(
            self.loggers, self.out_dir, self.run_name or self.out_dir.resolve().name, self.tracker_config()))
        try:
            self._fit(result, history, started, backend, publishers, weights, versions)
        finally:
            self._metrics.close()
        result.plot_path = plot_metrics(self.metrics_path, self.out_dir / "reward.png")
        self.close()
        return result

    def tracker_config(self) -> dict[str, Any]:
        """The run's settings as the trackers record them (params, config)."""
        config = {k: getattr(self, k) for k in ("backend", "served_name", "n", "tasks_per_step", "steps", "level",
                                                 "credit", "seed", "overlap", "max_staleness", "eval_n")}
        config.update({f"local.{k}": v for k, v in dataclasses.asdict(self.local).items()
                       if isinstance(v, (int, float, str, bool)) or v is None})
        config["policies"] = dict(self.policies) if self.policies else None
        return config

    def _fit(self, result: TrainResult, history: list[dict[str, Any]], started: float, backend: LocalBackend,
             publishers: Mapping[str, Publisher], weights: Callable[[str], Any], versions: dict[str, int]) -> None:
        if self.eval_tasks:
            result.eval_before = self.evaluate()
            self._log(history, {"step": 0, "eval_success": result.eval_before, "policy_version": 0, "time_s": 0.0})
        steps = _bar(self.steps, "train steps", self.progress)
        source = self.source if self.source is not None else self.live_source()
        source.start()
        try:
            for step in range(self.steps):
                batch = source.next_batch()
                if batch is None:
                    break
                updating = time.monotonic()
                line = self._train_step(step + 1, batch, backend, publishers, weights, versions)
                source.published(step + 1)
                line["update_s"] = round(time.monotonic() - updating, 3)  # samples, update and publish
                line["time_s"] = round(time.time() - started, 1)
                self._log(history, line, sample_rows(batch.groups))
                steps.update(1)
                steps.set_postfix(reward=f"{line['train_reward']:.2f}")
        finally:
            source.close()
            steps.close()
        if self.eval_tasks:
            result.eval_after = self.evaluate()
            self._log(history, {"step": sum(1 for x in history if "train_reward" in x),
                                "eval_success": result.eval_after, "policy_version": max(versions.values()),
                                "time_s": round(time.time() - started, 1)})

    def _train_step(self, step: int, batch: StepBatch, backend: LocalBackend, publishers: Mapping[str, Publisher],
                    weights: Callable[[str], Any], versions: dict[str, int]) -> dict[str, Any]:
        """One update from one batch: samples, the stale ones dropped, each policy updated on its own
        samples and published (recording the batch's groups); returns the metrics line."""
        team = self.policies is not None
        judged: dict[str, int] = {}
        if self.judge is not None:  # the judge rewards what the agent left unrewarded, then the groups are re-read
            judged = self.judge.reward_groups(self.store, batch.group_ids)
            fresh = read_groups(self.store, batch.group_ids, credit=self.credit)
            batch = StepBatch(batch.group_ids, fresh.groups, batch.outcomes, batch.metrics, batch.samples)
        samples, rewards, counts = self.batch_samples(batch)
        counts.update(judged)
        samples, stale = self.drop_stale(samples, versions, default_policy=None if team else self.served_name)
        line: dict[str, Any] = {"step": step, **counts, "train_reward": sum(rewards) / max(1, len(rewards)),
                                **stale, **batch.metrics}
        if team:
            stats = SampleStats()
            routed = route_by_policy(samples, self._served, stats)
            line["samples_unrouted"] = stats.unrouted  # calls to a served name no policy trains
            line["samples_off_their_policy"] = sum(  # an agent's call served under another agent's policy
                1 for s in samples if s.agent_name in self.policies and s.policy != self.policies[s.agent_name])
        else:
            routed = {self.served_name: samples}
        per_policy: dict[str, dict[str, Any]] = {}
        for name, found in routed.items():
            per_policy[name] = {"samples": len(found)}
            if found:
                per_policy[name].update(backend.update(found, policy=name if team else None))
                versions[name] += 1
                publish_and_record(publishers[name], self.store, weights(name), versions[name],
                                   trained_on=batch.group_ids)
            per_policy[name]["policy_version"] = versions[name]
        if team:
            memory = backend.memory()
            for name in self._served:
                per_policy[name].update(memory["policies"][name])
            line["policies"], line["base_mb"] = per_policy, memory["base_mb"]
        elif samples:
            line.update({k: v for k, v in per_policy[self.served_name].items() if k != "policy_version"})
        line["policy_version"] = max(versions.values())
        return line

    def close(self) -> None:
        """Stop the runners and their event loop (``fit`` does it at the end)."""
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _log(self, history: list[dict[str, Any]], line: dict[str, Any], samples: Sequence[Sequence[Any]] = ()) -> None:
        history.append(line)
        self._metrics.write(line, line["step"], samples)


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **kw: Any) -> None: ...
    def close(self) -> None: ...


def _bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False)


def plot_metrics(metrics_path: str | Path, out: str | Path) -> Path:
    """Reward against step from a metrics.jsonl (train reward per step, held-out success points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x.strip()]
    train = [(x["step"], x["train_reward"]) for x in lines if "train_reward" in x]
    evals = [(x["step"], x["eval_success"]) for x in lines if "eval_success" in x]
    if not train and not evals:
        raise ConfigurationError(f"{metrics_path} has no train_reward or eval_success lines to plot")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    if train:
        ax.plot(*zip(*train), marker="o", label="train reward (mean over rollouts)")
    if evals:
        ax.plot(*zip(*evals), marker="s", linestyle="--", label="held-out success")
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
