"""``Trainer.fit``: the training loop over a task set, on the same mechanism as production.

Each step: sample ``tasks_per_step`` tasks, queue each ``n`` times (one group), let runners execute
the traced agent against the served model, build samples from those groups, update the policy,
publish the new weights (policy version = step + 1), and append a metrics line to
``metrics.jsonl``. Succeeded rollouts are trained on with their rewards; rollouts the model made fail
with ``failure_reward``; a group with an infrastructure failure is left out whole
(``trainer_bridge/failures.py``). Everything left out is counted in the line (``batches.py``).
Optional held-out evaluation before and after (``mode="eval"``). ``plot_metrics`` draws reward
against step.

Where the batches come from is a sample source (``sources.py``): by default the task set, run live,
synchronously or overlapped. ``overlap=True, max_staleness=k``: the runner keeps taking tasks while
the trainer updates, a batch is the first ``tasks_per_step`` groups to complete, and new weights go
live while rollouts are in flight; each sample carries the policy version its call was served by
(the span's), and samples more than k versions behind the policy that served them are dropped and
counted (``samples_dropped_stale``; ``staleness``: a histogram of versions behind). ``max_staleness=0``
is the synchronous loop, by the same code. ``source=StoredGroups(store)`` replays a run already in a
store (nothing runs; ``replay.py``, ``lightning-rl train replay``). Every publish records the groups
it was trained on (``PolicyRecord.trained_on``).

Policies: one, ``served_name="policy"`` (every agent trains it), or a team,
``policies={"planner": "planner-lora", "solver": "solver-lora"}`` (each agent its own LoRA on the one
base model; two may share one). Both are the same mapping inside (``policies.py``: one policy is
``{"*": served_name}``): each policy is a named adapter of the local backend, published and versioned
on its own; a step routes the samples to the policies that trained them, updates each policy that
has samples and publishes it.

The settings are keyword-only and validated when the trainer is made (``config.py``); nothing is
rewritten afterwards. ``sft`` warm-starts the policies; ``fit`` then starts from that adapter.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from ..errors import ConfigurationError, WorkersFailed
from ..records import RolloutStatus, Sample
from ..store.queries import trajectory
from .algorithms import needs_groups
from .batches import batch_samples, drop_stale
from .config import ConfigModel, Count, Credit, Flag, LocalConfig, Loggers, Name, NonNegativeInt, Positive
from .failures import INFRA_ERRORS
from .local import LocalBackend, load_adapter
from .loggers import MetricsLog, make_loggers, sample_rows
from .plotting import plot_metrics
from .policies import Policies
from .publishers import Publisher, check_served, make_publisher, publish_and_record
from .loop_thread import LoopThread
from .runner import Runner, run_in_processes
from .sources import LiveGroups, StepBatch, read_groups

@dataclass
class TrainResult:
    history: list[dict[str, Any]]
    metrics_path: Path
    plot_path: Path | None
    eval_before: float | None = None
    eval_after: float | None = None


class Trainer(ConfigModel):
    """Train the served model on a task set (module doc). Keyword arguments only."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    agent: Callable[[Any], Any] | None = Field(None, repr=False)  # None only with source= (a replay runs none)
    tasks: Sequence[Any] = Field((), repr=False)
    store: Any = Field(repr=False)  # the store the tasks are queued in and the rollouts read from
    model_dir: Path
    server_url: str | list[str] | None = None  # a vLLM server or a replica set; None only with source= (a replay)
    served_name: Name = "policy"  # one policy: the LoRA name every agent calls
    policies: Any = None  # a team: agent name -> served name of its LoRA (checked by policies.Policies)
    out_dir: Path = Path(".cache/train")
    n: Count = Field(8, description="tries per task: one group, compared by GRPO")
    tasks_per_step: Count = Field(8, description="groups per update")
    steps: Count = Field(20, description="updates")
    eval_tasks: Sequence[Any] = Field((), repr=False)
    eval_agent: Callable[[Any], Any] | None = Field(None, repr=False)
    eval_n: Count = 1
    concurrency: Count = Field(16, description="tries run at once")
    level: Literal["call", "trajectory"] = "call"
    credit: Credit = "final"
    agents: str | Sequence[str] | None = None  # the agents trained (None: policies.py, "Agents trained")
    local: LocalConfig = Field(default_factory=LocalConfig)
    seed: Annotated[int, Field(strict=True)] = 0
    lease_seconds: Positive = 60.0
    rollout_timeout: Positive | None = 120.0
    progress: Flag = True
    publisher: Any = None  # a Publisher for the one served name (default: vllm_lora per served name)
    processes: NonNegativeInt = Field(0, description="> 0: sync agents run in this many worker processes "
                                      "(SQLite store, importable agent)")
    failure_reward: Annotated[float, Field(strict=True, allow_inf_nan=False)] = 0.0  # a try the model made fail
    infra_errors: frozenset[str] = INFRA_ERRORS  # error types that are not the model's: their group is dropped
    overlap: Flag = False  # rollouts go on while the trainer updates (bounded by max_staleness)
    max_staleness: NonNegativeInt = Field(0, description="versions a sample may be behind the policy that served "
                                          "it; default 1 with overlap=True, else 0")
    source: Any = None  # a SampleSource; None: the task set, run live (sources.LiveGroups)
    loggers: Loggers = ()  # experiment trackers beside metrics.jsonl: "tensorboard", "mlflow", "wandb"
    run_name: str | None = None  # the trackers' run name (default: the out_dir's name)
    init_adapter: Path | Mapping[str, Path] | None = None  # start from this LoRA (policies.py, "Layout")
    judge: Any = None  # a GroupJudge: rewards the tries a task set leaves unrewarded (lightning_rl.judge)
    # every try in a sandbox of its own (Runner's): a SandboxPool, a PoolPerTask or a pool spec; after a try that
    # succeeded, protect= is restored in it and score(task, sandbox) is its reward; a sandbox that fails is the
    # infrastructure's failure (its group is dropped), never a zero reward
    sandboxes: Any = Field(None, repr=False)
    score: Any = Field(None, repr=False)
    protect: Sequence[str] = ()
    infra_retries: NonNegativeInt = 2

    _policies: Policies = PrivateAttr()
    _agents: str | list[str] | None = PrivateAttr(None)
    _sft_adapter: Path | None = PrivateAttr(None)
    _rng: random.Random = PrivateAttr()
    _runners: dict[int, Runner] = PrivateAttr(default_factory=dict)
    # One event loop for every runner of this trainer (evaluation and training): async clients
    # such as AsyncOpenAI's connection pool are bound to the loop they first ran on.
    _loop: LoopThread | None = PrivateAttr(None)
    _metrics: MetricsLog | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _staleness_default(cls, settings: Any) -> Any:
        if isinstance(settings, dict) and settings.get("max_staleness") is None:
            settings = {**settings, "max_staleness": 1 if settings.get("overlap") is True else 0}
        return settings

    def model_post_init(self, context: Any) -> None:
        if self.source is None:
            if self.agent is None:
                raise ConfigurationError("Trainer needs the agent to run (a traced function), got None; only a "
                                         "replay (source=StoredGroups(store)) runs none")
            if not self.tasks:
                raise ConfigurationError("Trainer needs at least one task")
            if not self.server_url:
                raise ConfigurationError("Trainer needs server_url, the vLLM server its agent calls and its new "
                                         "weights are loaded into (only a replay, source=, trains without one)")
            if self.max_staleness and not self.overlap:
                raise ConfigurationError(f"max_staleness={self.max_staleness} lets samples be {self.max_staleness} "
                                         "version(s) behind, which happens only when rollouts overlap updates: set "
                                         "overlap=True, or max_staleness=0")
        policies = self._policies = Policies.of(self.policies, served_name=self.served_name)
        self._agents = policies.agents(self.agents)
        self.local.check_policies(policies.served)
        if self.publisher is not None and [getattr(self.publisher, "served_name", None)] != policies.served:
            raise ConfigurationError(
                f"publisher= publishes one served name ({getattr(self.publisher, 'served_name', None)!r}), and this "
                f"trainer trains {policies.served}; give it served_name={policies.served[0]!r}, or drop publisher= "
                "(the trainer makes a vllm_lora publisher per served name)")
        if isinstance(self.init_adapter, Mapping):
            unknown = sorted(set(self.init_adapter) - set(policies.served))
            if unknown:
                raise ConfigurationError(f"init_adapter names policies this trainer does not train: {unknown}; its "
                                         f"served names are {policies.served}")
        estimators = {self.local.for_policy(name).adv_estimator for name in policies.served}
        grouped = sorted(estimator for estimator in estimators if needs_groups(estimator))
        if self.n < 2 and grouped:
            raise ConfigurationError(
                f"the advantage estimator {grouped[0]!r} compares the tries of a task, so it needs n >= 2 (got "
                f"n={self.n}); raise n, or use LocalConfig(adv_estimator='batch_baseline')")
        if self.sandboxes is not None and self.processes:
            raise ConfigurationError(f"sandboxes= gives each try a sandbox from this process's pool, and processes="
                                     f"{self.processes} runs the agent in worker processes: set processes=0")
        if self.score is not None and self.sandboxes is None:
            raise ConfigurationError("score= runs in each try's sandbox after its agent: give sandboxes= too")
        self._rng = random.Random(self.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    @property
    def policy_names(self) -> list[str]:
        """The served names trained, in order (one per policy)."""
        return list(self._policies.served)

    @property
    def trained_agents(self) -> str | list[str] | None:
        """The agents whose samples train (None: every agent; a pattern, or the names)."""
        return self._agents

    @property
    def start_adapter(self) -> Path | Mapping[str, Path] | None:
        """What ``fit`` starts from: the adapter ``sft`` trained, else ``init_adapter``."""
        return self._sft_adapter if self._sft_adapter is not None else self.init_adapter

    # -- rollouts -----------------------------------------------------------------------------------
    def _in_processes(self, agent: Callable[[Any], Any]) -> bool:
        return bool(self.processes) and not inspect.iscoroutinefunction(agent)

    def _run_in_processes(self, agent: Callable[[Any], Any], groups: list[str]) -> None:
        codes = run_in_processes(self.store.url, agent, groups, processes=self.processes,
                                 lease_seconds=self.lease_seconds, rollout_timeout=self.rollout_timeout)
        if any(codes):
            raise WorkersFailed(f"{sum(1 for code in codes if code)} of {len(codes)} worker processes exited non-zero "
                                f"(exit codes {codes}; a negative one is the signal that ended it): their output above "
                                "says why; fix that, or set processes=0 to run the agent in this process", codes)
        self.store.flush()

    def _runner(self, agent: Callable[[Any], Any]) -> Runner:
        """One runner per agent for the whole run, all on the trainer's one event loop (a thread)."""
        runner = self._runners.get(id(agent))
        if runner is None:
            if self._loop is None:
                self._loop = LoopThread()
            runner = self._runners[id(agent)] = Runner(
                self.store, agent, concurrency=self.concurrency, lease_seconds=self.lease_seconds,
                rollout_timeout=self.rollout_timeout, loop=self._loop, sandboxes=self.sandboxes, score=self.score,
                protect=list(self.protect), infra_retries=self.infra_retries)
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
        """The samples of these groups in this trainer's store (``batches.batch_samples``)."""
        return self._batch_samples(read_groups(self.store, groups, credit=self.credit))

    def _batch_samples(self, batch: StepBatch) -> tuple[list[Sample], list[float], dict[str, Any]]:
        return batch_samples(batch, level=self.level, agents=self._agents, infra_errors=self.infra_errors,
                             failure_reward=self.failure_reward)

    def evaluate(self, tasks: Sequence[Any] | None = None, *, n: int | None = None) -> float:
        """Mean final reward of held-out tasks (``mode="eval"``; failed rollouts count as 0)."""
        tasks = list(tasks if tasks is not None else self.eval_tasks)
        groups = self._run_groups(self.eval_agent or self.agent, tasks, n or self.eval_n, "eval", "eval")
        entries = self.store.queue_entries(groups)
        rewards = [trajectory(self.store, e.rollout_id).final_reward or 0.0
                   if e.outcome == RolloutStatus.SUCCEEDED else 0.0 for e in entries]
        return sum(rewards) / max(1, len(rewards))

    # -- warm start ---------------------------------------------------------------------------------
    def sft(self, data: Any, *, epochs: int = 2, lr: float | None = None) -> dict[str, Any]:
        """Warm-start the policies by supervised fine-tuning on ``data`` (what ``lightning-rl export --format
        chat`` or ``--format tokens`` writes: a path or its lines; ``sft.sft_samples``), with the same PEFT
        setup ``fit`` uses; ``fit`` then starts from it (``start_adapter``; version 0 is the SFT policy).
        Each policy learns from its own agents' examples (``sft.warm_start``). Returns the SFT's losses and
        counts, also written to ``out_dir/sft.json``."""
        from .sft import warm_start

        stats, self._sft_adapter = warm_start(data, self.model_dir, self.out_dir, local=self.local, seed=self.seed,
                                              epochs=epochs, lr=lr, policies=self._policies)
        return stats

    def _init_adapters(self) -> dict[str, Path]:
        """``start_adapter`` as served name -> adapter folder: a mapping as it is, or a folder laid out as
        ``policies.py`` says ("Layout": what ``sft`` writes; a policy without one starts from a fresh LoRA)."""
        start = self.start_adapter
        if start is None:
            return {}
        if isinstance(start, Mapping):
            return {name: Path(folder) for name, folder in start.items()}
        folders = self._policies.folders(start)
        found = {name: folder for name, folder in folders.items() if (folder / "adapter_config.json").is_file()}
        if not found:
            raise ConfigurationError(f"init_adapter {str(start)!r} holds no adapter folder of a policy this trainer "
                                     f"trains (no adapter_config.json in {sorted(map(str, folders.values()))}); "
                                     "one policy's SFT writes sft_adapter/, a team's sft_adapter/<served name>/")
        return found

    # -- the loop -----------------------------------------------------------------------------------
    def _publisher(self, name: str, folder: Path) -> Publisher:
        if self.publisher is not None:
            return self.publisher
        if self.server_url is None:  # a replay: the adapters are saved, nothing is served
            return make_publisher("adapter_dir", adapter_dir=folder, served_name=name)
        return make_publisher("vllm_lora", server_url=self.server_url, served_name=name, adapter_dir=folder)

    def fit(self) -> TrainResult:
        served = self._policies.served
        backend = LocalBackend(self.model_dir, self.local, seed=self.seed, policies=served)
        for name, folder in self._init_adapters().items():
            load_adapter(backend, folder, policy=name)
        folders = self._policies.folders(self.out_dir / "adapters")
        publishers = {name: self._publisher(name, folders[name]) for name in served}
        versions = dict.fromkeys(served, 0)
        for name in served:
            publish_and_record(publishers[name], self.store, backend.adapter(name), 0)
        if self.server_url is not None and self.publisher is None:
            check_served(self.server_url, served)
        started = time.time()
        history: list[dict[str, Any]] = []
        result = TrainResult(history, self.metrics_path, None)
        self._metrics = MetricsLog(self.metrics_path, make_loggers(
            self.loggers, self.out_dir, self.run_name or self.out_dir.resolve().name, self.tracker_config()))
        try:
            self._fit(result, history, started, backend, publishers, versions)
        finally:
            self._metrics.close()
        result.plot_path = plot_metrics(self.metrics_path, self.out_dir / "reward.png")
        self.close()
        return result

    def tracker_config(self) -> dict[str, Any]:
        """The run's settings as the trackers record them (params, config)."""
        config = {k: getattr(self, k) for k in ("served_name", "n", "tasks_per_step", "steps", "level", "credit",
                                                 "seed", "overlap", "max_staleness", "eval_n")}
        config.update({f"local.{k}": v for k, v in self.local.scalars().items()})
        config["policies"] = dict(self.policies) if self.policies else None
        return config

    def _fit(self, result: TrainResult, history: list[dict[str, Any]], started: float, backend: LocalBackend,
             publishers: Mapping[str, Publisher], versions: dict[str, int]) -> None:
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
                line = self._train_step(step + 1, batch, backend, publishers, versions)
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
                    versions: dict[str, int]) -> dict[str, Any]:
        """One update from one batch: samples, the stale ones dropped, each policy updated on its own
        samples and published (recording the batch's groups); returns the metrics line."""
        policies = self._policies
        judged: dict[str, int] = {}
        if self.judge is not None:  # the judge rewards what the agent left unrewarded, then the groups are re-read
            judged = self.judge.reward_groups(self.store, batch.group_ids)
            fresh = read_groups(self.store, batch.group_ids, credit=self.credit)
            batch = StepBatch(batch.group_ids, fresh.groups, batch.outcomes, batch.metrics, batch.samples)
        samples, rewards, counts = self._batch_samples(batch)
        counts.update(judged)
        samples, stale = drop_stale(samples, versions, self.max_staleness, policies.serving)
        line: dict[str, Any] = {"step": step, **counts, "train_reward": sum(rewards) / max(1, len(rewards)),
                                **stale, **batch.metrics}
        routed, line["samples_unrouted"] = policies.route(samples)  # calls to a model no policy trains
        line["samples_off_their_policy"] = policies.off_their_policy(samples)  # an agent's call served by another
        per_policy: dict[str, dict[str, Any]] = {}
        for name, found in routed.items():
            per_policy[name] = {"samples": len(found)}
            if found:
                per_policy[name].update(backend.update(found, policy=name))
                versions[name] += 1
                publish_and_record(publishers[name], self.store, backend.adapter(name), versions[name],
                                   trained_on=batch.group_ids)
            per_policy[name]["policy_version"] = versions[name]
        memory = backend.memory()
        for name in policies.served:
            per_policy[name].update(memory["policies"][name])
        line.update(policies.figures(per_policy, own=("policy_version", "adapter_mb", "optimizer_mb")))
        line["base_mb"] = memory["base_mb"]
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
