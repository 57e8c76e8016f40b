"""``replay``: train a fresh LoRA on a run already in a store, running nothing (``lightning-rl train replay``).

The batches are the run's own (``sources.StoredGroups``: what each publish was trained on, else the
train groups in queue order, ``tasks_per_step`` a batch); the trainer is ``Trainer`` with that source,
no agent and no server, so the same store, seed and settings give the same loss sequence. The replay's
publishes go to a store of its own (``out_dir/replay.db``), never into the run's; its adapters and
``metrics.jsonl`` to ``out_dir``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..store.uri import open_store
from .config import LocalConfig
from .sources import StoredGroups
from .trainer import Trainer, TrainResult


def replay(run: Any, *, model_dir: str | Path, out_dir: str | Path = ".cache/replay", served_name: str | None = None,
           policies: Mapping[str, str] | None = None, local: LocalConfig | None = None, seed: int = 0,
           steps: int | None = None, tasks_per_step: int | None = None, max_staleness: int = 0,
           credit: str = "final", level: str = "call", loggers: Sequence[Any] = ()) -> TrainResult:
    """Replay the run in ``run`` (a store, or its URL or path) from a fresh LoRA of ``model_dir`` (module doc).

    ``served_name``: the policy to replay (default: the run's one served name); ``policies``: a team's,
    as ``Trainer`` takes them. ``seed``, ``max_staleness``, ``credit``, ``level`` and ``local``: the
    run's, to repeat its losses. ``steps``: at most this many batches; ``tasks_per_step``: groups per
    batch, for a run whose publishes do not say what they were trained on."""
    opened = open_store(run) if isinstance(run, (str, Path)) else None
    store = opened or run
    try:
        if served_name is None and policies is None:  # the run's one served name
            names = sorted({p.served_name for p in store.policies()})
            if len(names) > 1:
                raise ConfigurationError(f"{store.url} has publishes of {names}: a team; give policies= (--policy "
                                         "AGENT=SERVED for each agent), or served_name= for the one policy to replay")
            served_name = names[0] if names else "policy"
        source = StoredGroups(store, credit=credit, tasks_per_step=tasks_per_step, steps=steps)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
        record = open_store(f"sqlite:///{out / 'replay.db'}")  # the replay's own publishes, not the run's store
        try:
            trainer = Trainer(store=record, model_dir=model_dir, out_dir=out, served_name=served_name or "policy",
                              policies=policies, steps=max(1, len(source.batches)), seed=seed, credit=credit,
                              level=level, max_staleness=max_staleness, source=source, local=local or LocalConfig(),
                              progress=False, loggers=list(loggers))
            return trainer.fit()
        finally:
            record.close()
    finally:
        if opened is not None:
            opened.close()
