"""The served log-prob gap: how far the weights the engine sampled from are from the actor's (``trainer.py`` reads it
every step). verl-free, so it is tested without verl."""

from __future__ import annotations

import math
from typing import Any

DEFAULT_GAP_LIMIT = math.log(2.0)  # the packaged rollout_is_threshold


def gap_limit(rollout_correction: Any) -> float:
    """The served log-prob gap past which a step warns: ln of the importance weights' cap (module doc)."""
    cap = rollout_correction.get("rollout_is_threshold", None) if rollout_correction is not None else None
    try:
        return math.log(float(cap)) if cap is not None and float(cap) > 1.0 else DEFAULT_GAP_LIMIT
    except (TypeError, ValueError):  # a lower/upper pair: the upper bound caps
        return DEFAULT_GAP_LIMIT


def logprob_gap(engine: Any, actor: Any, mask: Any, limit: float) -> dict[str, float]:
    """|engine - actor| log-prob over the tokens ``mask`` trains: max, mean, and how many are over ``limit``."""
    trained = mask.bool()
    diff = (engine.float() - actor.float()).abs()[trained]
    if diff.numel() == 0:
        return {"lightning_rl/served_logprob_gap_max": 0.0, "lightning_rl/served_logprob_gap_mean": 0.0,
                "lightning_rl/served_logprob_gap_over": 0.0}
    return {"lightning_rl/served_logprob_gap_max": float(diff.max()),
            "lightning_rl/served_logprob_gap_mean": float(diff.mean()),
            "lightning_rl/served_logprob_gap_over": float((diff > limit).sum())}
