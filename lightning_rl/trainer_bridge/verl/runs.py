"""A verl run's identity in the store: its run record and its version base (verl-free, so the launcher, the agent
loop and the tests share it).

verl numbers its weights by global step, from 0 in every run. Published under the served name as they are, two
runs of one model in one store would both publish versions 0, 1, 2, ... and every call and rollout would be
stamped with numbers that name two different weights. So each run has a **version base**: the launcher
(``main.py``) gives a new run the number after the newest version of its served name in the store (0 in an
empty one) and a resumed run (its run record in ``trainer.default_local_dir``) the base it recorded, and hands it
to every verl process as ``LIGHTNING_RL_VERL_VERSION_BASE``. A publish's version and a call's stamp are base +
global step; the rows verl reads keep verl's own global steps (``min_global_steps``/``max_global_steps``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...diagnostics import report_failure
from ...settings import verl_version_base
from .launch import served_model_name

RUN_RECORD = "lightning_rl_run.json"


def version_base() -> int:
    """The run's version base (``LIGHTNING_RL_VERL_VERSION_BASE``; 0 when unset)."""
    return verl_version_base()


def recorded_version_base(local_dir: str) -> int | None:
    """The version base the run saved in ``local_dir`` recorded (a resumed run keeps it), if any."""
    try:
        with open(os.path.join(local_dir, RUN_RECORD)) as f:
            base = json.load(f).get("version_base")
    except (OSError, ValueError):
        return None
    return base if isinstance(base, int) and not isinstance(base, bool) else None


def new_version_base(store: Any, served_name: str, local_dir: str) -> int:
    """The version base of a run of ``served_name`` saving to ``local_dir``: the one it recorded (resumed), else
    one past the newest version of ``served_name`` in ``store``, else 0."""
    recorded = recorded_version_base(local_dir)
    if recorded is not None:
        return recorded
    published = store.policies(served_name)
    return max(p.version for p in published) + 1 if published else 0


def write_run_record(config: Any) -> None:
    """``lightning_rl_run.json`` beside the run's checkpoints: the base model, the served name and the version
    base, which ``export-model --verl-checkpoint`` (a LoRA's base model) and a resumed run read. Not the store's
    URL: it may hold a password."""
    folder = str(config.trainer.default_local_dir)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, RUN_RECORD), "w") as f:
            json.dump({"model_path": str(config.actor_rollout_ref.model.path), "served_name": served_model_name(config),
                       "version_base": version_base()}, f, indent=1)
    except OSError as exc:  # an export can still be given --base-model
        report_failure("writing the verl run record", exc)
