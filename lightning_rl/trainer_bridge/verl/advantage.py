"""verl's advantage step, computed by lightning-rl's rules: failures out of the batch, each segment's own reward.

verl 0.9.1's V1 trainer computes GRPO from each try's last row only (``v1/utils.py``
``compute_advantage_for_multi_trajectories``): the last row's advantage, read at its first unmasked token, is
given to the try's other rows, after its agent-loop worker copied the last row's reward over them. So under
plain verl a try whose last segment has no gradient (no engine log-probs) gets advantage 0 on every segment
while its reward still counts in its group, every credit rule is reduced to the last segment's reward, and an
infrastructure failure's placeholder reward (0.0) enters its group's mean and std. ``LightningRLSyncTrainer``
replaces that step (``_compute_advantage``) with :func:`compute_advantage`:

1. **Failures.** A GRPO group (verl's ``uid``) with a row whose ``extra_fields["failure"]`` is ``infra`` (an
   infrastructure failure, a try no runner finished) leaves the batch: its rows get advantage 0 and response
   mask 0, which verl's loss ignores (as it ignores its own padding rows), and it is not in any statistics.
   The other groups' advantages are those of the batch without it. The local trainer's rule
   (``failures.py``).
2. **Credit.** Each row's reward is its own segment's reward after credit (``extra_fields["segment_reward"]``,
   ``rows.py``). The group's mean and std are taken over its tries, one score per try (the mean of its rows'
   rewards), and each row's advantage is its own reward against them: ``algorithms.grpo_outcome_advantage``
   with ``rollout_index``, the local trainer's GRPO. With one row per try (or ``credit=final``, where every
   segment has the try's reward) it is verl's GRPO exactly; a masked row's reward counts for its try, its
   tokens get no gradient, and the try's other rows keep theirs.
3. verl's rollout correction (importance weights from the engine's log-probs, rejection) runs as verl runs it.
4. A batch left with no trained token (every group failed, every row masked) is counted
   (``lightning_rl/trained_tokens`` 0) and the trainer skips its update: verl's correction raises on it and its
   token-mean loss would divide 0 by 0.

Only what this step can honour is accepted at launch (``launch.check_verl_config``): ``adv_estimator=grpo``, no
KL in the reward, no colocated reward model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..algorithms import grpo_outcome_advantage
from ..failures import FailureCounts


@dataclass(frozen=True, slots=True)
class RowPlan:
    """What the advantage of one row of verl's batch is computed from."""

    group: str  # verl's uid: the GRPO group
    session: str  # ``{uid}_{session}``: the try
    reward: float  # the segment's own reward after credit
    failure: str  # "", "model" or "infra"
    padding: bool  # one of verl's synthetic padding rows


def plan_rows(keys: Sequence[str], tags: Sequence[Mapping[str, Any]], extra_fields: Sequence[Any],
              scores: Sequence[float]) -> list[RowPlan]:
    """One plan per row of the batch: verl's key (``{uid}_{session}_{i}``), its tags (``is_padding``), our
    ``extra_fields`` and the row's verl score (``rm_scores`` summed: used only for rows our loop did not make)."""
    plans = []
    for key, tag, extra, score in zip(keys, tags, extra_fields, scores, strict=True):
        uid, session, _ = key.rsplit("_", 2)
        extra = extra if isinstance(extra, Mapping) else {}
        reward = extra.get("segment_reward")
        plans.append(RowPlan(group=uid, session=f"{uid}_{session}", reward=float(score if reward is None else reward),
                             failure=str(extra.get("failure") or ""), padding=bool(tag.get("is_padding", False))))
    return plans


def row_advantages(plans: Sequence[RowPlan], response_mask: torch.Tensor, *, norm_adv_by_std: bool = True,
                   epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, FailureCounts]:
    """``(advantages [B, R], kept [B] bool, counts)`` for the rows ``plans`` describes (module doc): a dropped or
    padding row has advantage 0 and ``kept`` False."""
    real = [p for p in plans if not p.padding]  # verl's padding rows copy a real row's fields: never counted
    failed = {p.group for p in real if p.failure == "infra"}
    kept = torch.tensor([not p.padding and p.group not in failed for p in plans], dtype=torch.bool)
    counts = FailureCounts(model_failures=len({p.session for p in real if p.failure == "model"}),
                           infra_failures=len({p.session for p in real if p.failure == "infra"}),
                           groups_dropped=len(failed), tries_dropped=len({p.session for p in real if p.group in failed}))
    advantages = torch.zeros(response_mask.shape, dtype=torch.float32)
    index = [i for i, keep in enumerate(kept.tolist()) if keep]
    if index:
        rewards = torch.tensor([[plans[i].reward] for i in index], dtype=torch.float32)
        scalar, _ = grpo_outcome_advantage(rewards, torch.ones_like(rewards),
                                           np.array([plans[i].group for i in index], dtype=object),
                                           epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std,
                                           rollout_index=np.array([plans[i].session for i in index], dtype=object))
        advantages[index] = scalar * response_mask[index].to(torch.float32)
    return advantages, kept, counts


def compute_advantage(trainer: Any, batch: Any, metrics: dict) -> Any:
    """verl's ``PPOTrainer._compute_advantage`` with lightning-rl's advantage (module doc), on verl's TransferQueue
    batch ``batch``; ``trainer`` is verl's trainer (its ``config``). Returns the batch."""
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.workers.utils.padding import response_to_nested

    config = trainer.config
    fields = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    extra = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    nested_mask = data["response_mask"]
    data = DataProto(batch=data.to_padded_tensor())
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]

    corr = config.algorithm.get("rollout_correction", None)
    bypass = bool(corr and corr.get("bypass_mode", False))
    trainable = bool(data.batch["response_mask"].any())  # verl's correction raises on a batch without one token
    correction = corr is not None and "rollout_log_probs" in data.batch and not bypass and trainable
    if correction:  # as verl's step: importance weights and rejection from the engine's log-probs
        data, is_metrics = compute_rollout_correction_and_add_to_batch(data, corr)
        metrics.update(is_metrics)

    plans = plan_rows(batch.keys, batch.tags, list(extra["extra_fields"]),
                      data.batch["rm_scores"].sum(dim=-1).tolist())
    advantages, kept, counts = row_advantages(plans, data.batch["response_mask"],
                                              norm_adv_by_std=config.algorithm.get("norm_adv_by_std_in_grpo", True))
    data.batch["response_mask"] = data.batch["response_mask"] * kept.unsqueeze(-1).to(data.batch["response_mask"].dtype)
    data.batch["advantages"] = advantages
    data.batch["returns"] = advantages
    metrics.update({f"lightning_rl/{k}": v for k, v in counts.as_metrics().items()})
    tokens = int(data.batch["response_mask"].sum())
    metrics["lightning_rl/trained_tokens"] = tokens
    trainer.lightning_rl_trained_tokens = tokens  # 0: the trainer skips the update (a token mean over none is 0/0)

    out = ["advantages", "returns", "response_mask"] + (["rollout_is_weights"] if "rollout_is_weights" in data.batch
                                                        else [])
    written = TensorDict({f: response_to_nested(data.batch[f], nested_mask) for f in out}, batch_size=len(batch))
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=written)
