"""``plot_metrics``: reward against step from a run's ``metrics.jsonl`` (``lightning-rl plot``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigurationError


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
