"""Experiment trackers: every metrics line a trainer writes to ``metrics.jsonl`` goes to them too.

``Trainer(loggers=["tensorboard", "mlflow", "wandb"])``, ``ContinuousTrainer(loggers=...)`` or
``lightning-rl train run|continuous|replay --logger NAME``; a registry like the credit rules (``register_logger``). A logger
is made with the run's output directory, a run name and the run's settings, and gets:

* ``log(metrics, step)``: the line's numbers under verl's names where verl logs the same quantity,
  so a verl user's dashboards carry over (``tracker_metrics``: ``actor/pg_clipfrac``,
  ``critic/score/mean``, ``response_length/mean``, ``rollout_corr/rollout_is_mean``, ...), the rest
  under ``lightning_rl/<name>``; a team's per-policy numbers as ``<policy>/<verl name>``.
* ``log_samples(columns, rows, step)``: a few of the step's trajectories (task, answer, reward) as a
  table where the tracker has tables (W&B ``Table``), else as text (TensorBoard) or a JSON artifact
  (MLflow).

Where each writes, by default: TensorBoard event files in ``<out>/tensorboard/<run>``, an MLflow file
store in ``<out>/mlruns`` (or ``MLFLOW_TRACKING_URI``; MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true``
for a file store, which this sets when it picks one), W&B under ``<out>/wandb``, offline unless
``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is set. The trackers are optional packages
(``pip install 'lightning-rl[trackers]'``); asking for one that is not installed is an error that
names the package. A tracker that fails mid-run is logged and counted, never stops the training:
``metrics.jsonl`` is the record.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..boundaries import is_real
from ..diagnostics import count, report_failure
from ..errors import ConfigurationError
from ..registry import Registry

# Our metrics-line keys -> verl's names for the same quantity (verl/trainer/ppo/metric_utils.py,
# dp_actor.py, rollout_corr_helper.py).
VERL_NAMES = {
    "pg_clipfrac": "actor/pg_clipfrac",
    "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
    "ppo_kl": "actor/ppo_kl",
    "loss": "actor/pg_loss",
    "grad_norm": "actor/grad_norm",
    "lr": "actor/lr",
    "kl": "actor/kl_loss",
    "entropy": "actor/entropy",
    "train_reward": "critic/score/mean",
    "reward_mean": "critic/rewards/mean",
    "response_tokens_mean": "response_length/mean",
    "rollout_is_mean": "rollout_corr/rollout_is_mean",
    "rollout_is_max": "rollout_corr/rollout_is_max",
    "samples_dropped_stale": "training/off_policy/evicted_samples",
    "update_s": "timing_s/update_actor",
    "step": "training/global_step",
}


def _number(value: Any) -> float | None:
    if not is_real(value):
        return None
    return float(value) if math.isfinite(value) else None


def staleness_mean(histogram: Mapping[Any, Any]) -> float | None:
    """Mean versions behind, from a metrics line's staleness histogram ({"0": n0, "1": n1, ...})."""
    counts = {int(k): v for k, v in histogram.items() if str(k).isdigit() and _number(v) is not None}
    total = sum(counts.values())
    return sum(k * n for k, n in counts.items()) / total if total else None


def tracker_metrics(line: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one metrics line, named for trackers (module doc). Non-numbers (text, lists) are
    left out; nested counts are flattened (``lightning_rl/outcomes/succeeded``); the staleness
    histogram also gives verl's ``training/off_policy/trajectory_staleness/{mean,max}``."""
    out: dict[str, float] = {}
    for key, value in line.items():
        if key == "policies" and isinstance(value, Mapping):  # a team: a policy's own numbers
            for policy, numbers in value.items():
                for name, number in tracker_metrics(numbers).items():
                    out[f"{policy}/{name}"] = number
            continue
        if key == "staleness" and isinstance(value, Mapping) and (mean := staleness_mean(value)) is not None:
            out["training/off_policy/trajectory_staleness/mean"] = mean
            out["training/off_policy/trajectory_staleness/max"] = float(max(int(k) for k in value if str(k).isdigit()))
        if isinstance(value, Mapping):
            for sub, number in value.items():
                if (x := _number(number)) is not None:
                    out[f"lightning_rl/{key}/{sub}"] = x
            continue
        x = _number(value)
        if x is None:
            continue
        out[VERL_NAMES.get(key, f"lightning_rl/{key}")] = x
    if "eval_success" in line and (x := _number(line["eval_success"])) is not None:
        out["val/success"] = x  # verl's val-core/<source>/<var>/mean@n needs names we do not have
    return out


class Logger(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_samples(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None: ...

    def close(self) -> None: ...


def _needs(package: str, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigurationError(f"the {package!r} logger needs the {package} package ({exc}); install it with: "
                                 f"pip install 'lightning-rl[trackers]' (or pip install {package})") from None


#: Trackers by name: ``factory(out_dir, run_name, config)`` returns an object with ``log``, ``log_samples``
#: and ``close``. Add one with ``@register_logger("name")`` on its factory (a class, usually).
LOGGERS: Registry[Callable[[Path, str, Mapping[str, Any]], Logger]] = Registry(
    "logger", hint="or register one with @register_logger")
register_logger = LOGGERS.register


@register_logger("tensorboard")
class TensorBoardLogger:
    """Scalars and sample tables (as markdown text) in TensorBoard event files."""

    def __init__(self, out_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        _needs("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = out_dir / "tensorboard" / run_name
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.writer.add_text("config", "```\n" + json.dumps(dict(config), indent=1, default=str) + "\n```", 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_samples(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        def cell(value: Any) -> str:
            return str(value).replace("|", "\\|").replace("\n", " ")

        table = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        table += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text("samples", "\n".join(table), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@register_logger("mlflow")
class MLflowLogger:
    """An MLflow run: the settings as params, metrics per step, samples as a JSON artifact per step."""

    def __init__(self, out_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        mlflow = _needs("mlflow", "mlflow")
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not self.tracking_uri:  # a local file store, which needs no database package (MLflow 3 keeps it
            # in "maintenance mode" and asks for this opt-in; MLFLOW_TRACKING_URI=sqlite:///... for a database)
            self.tracking_uri = (out_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "lightning-rl")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        for key, value in list(config.items())[:100]:
            self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k.replace("@", "_at_"), v, now, step)
                                                    for k, v in metrics.items()])

    def log_samples(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.client.log_dict(self.run_id, [dict(zip(columns, row)) for row in rows],
                             f"samples/step_{step:05d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@register_logger("wandb")
class WandbLogger:
    """A Weights & Biases run (offline by default: module doc); samples as a ``wandb.Table``."""

    def __init__(self, out_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        wandb = _needs("wandb", "wandb")
        self.wandb = wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        (out_dir / "wandb").parent.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lightning-rl"), name=run_name,
                              dir=str(out_dir), config=dict(config), mode=mode, reinit="create_new")
        self.run_dir = Path(self.run.dir).parent  # wandb/<offline-run-...>/files -> wandb/<offline-run-...>

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.run.log({"samples": self.wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()


def check_loggers(loggers: Sequence[str | Logger] | None) -> None:
    """Refuse unknown names and non-loggers before a run starts (nothing is opened here)."""
    if isinstance(loggers, (str, bytes)):
        raise ConfigurationError(f"loggers is a list of names or logger objects, e.g. ['tensorboard'], got {loggers!r}")
    for spec in loggers or ():
        if isinstance(spec, str):
            LOGGERS.get(spec)  # an unknown name: UnknownNameError listing the known ones
        elif not all(callable(getattr(spec, m, None)) for m in ("log", "log_samples", "close")):
            raise ConfigurationError(f"a logger is a registered name ({', '.join(sorted(LOGGERS))}) or an object "
                                     f"with log, log_samples and close; got {spec!r}")


def make_loggers(loggers: Sequence[str | Logger] | None, out_dir: Path, run_name: str,
                 config: Mapping[str, Any]) -> list[Logger]:
    """The trackers asked for: names from the registry, or logger objects as they are."""
    check_loggers(loggers)
    return [LOGGERS.get(spec)(Path(out_dir), run_name, config) if isinstance(spec, str) else spec
            for spec in loggers or ()]


SAMPLE_COLUMNS = ("rollout_id", "group_id", "agent", "task", "reward", "calls", "answer")


def sample_rows(groups: Sequence[Sequence[Any]], limit: int = 4) -> list[list[Any]]:
    """A few trajectories of a batch, one per group first, as rows of ``SAMPLE_COLUMNS``."""
    rows: list[list[Any]] = []
    for depth in range(max((len(g) for g in groups), default=0)):
        for group in groups:
            if len(rows) >= limit:
                return rows
            if depth < len(group):
                t = group[depth]
                answer = t.llm_calls[-1].response_text if t.llm_calls else ""
                rows.append([t.rollout_id, t.group_id, ",".join(t.agents) or t.name,
                             json.dumps(t.task, default=str)[:500], t.final_reward, len(t.llm_calls),
                             (answer or "")[:1000]])
    return rows


class MetricsLog:
    """``metrics.jsonl`` (the record) and the trackers (copies that may fail without harm)."""

    def __init__(self, path: Path, loggers: Sequence[Logger] = ()) -> None:
        self.path, self.loggers = path, list(loggers)

    def write(self, line: Mapping[str, Any], step: int, samples: Sequence[Sequence[Any]] = ()) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        if not self.loggers:
            return
        metrics = tracker_metrics(line)
        for logger in self.loggers:
            try:
                logger.log(metrics, step)
                if samples:
                    logger.log_samples(SAMPLE_COLUMNS, samples, step)
            except Exception as exc:
                count("tracker_failures")
                report_failure(f"logging to {type(logger).__name__}", exc)

    def close(self) -> None:
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:
                count("tracker_failures")
                report_failure(f"closing {type(logger).__name__}", exc)
