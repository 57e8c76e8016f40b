"""Samples to verl's ``DataProto``, laid out the way verl's own agent loop lays out a batch.

``to_dataproto(samples, pad_token_id=..., max_prompt_length=P, max_response_length=R)``:

* ``prompts`` [B, P] left-padded; ``responses`` [B, R] right-padded; ``input_ids`` = both;
* ``response_mask`` [B, R]: the sample's mask (1 = generated, 0 = tool/observation), 0 on padding;
* ``attention_mask`` [B, P+R]: 0 on padding only (observation tokens are attended);
* ``position_ids`` = cumsum(attention_mask) - 1, clamped at 0 (verl's ``compute_position_id_with_mask``);
* ``rollout_log_probs`` [B, R]: the engine's log-probs, 0.0 at observation and padding positions
  (present when every sample has them);
* ``rm_scores`` [B, R]: the sample's scalar ``reward`` at its last attended response token (verl's
  placement). ``use_token_rewards=True`` places ``token_rewards`` instead. Those are per-call
  *credited* values, so summing them (as outcome estimators do) counts a shared reward once per
  merged call; use them only with an estimator that reads per-token rewards;
* non-tensor: ``uid`` (the GRPO group: ``group_id``, per policy when the samples come from several,
  as ``group_keys`` says), ``agent_name``, ``policy`` (the served name the calls went to),
  ``policy_version``, ``rollout_id``, ``multi_modal_inputs`` (an empty dict per row: the legacy
  trainer iterates it);
* ``meta_info``: ``temperature`` (mandatory for verl), ``lightning_rl_metrics`` (counts below).

Length rule (counted in ``meta_info["lightning_rl_metrics"]``): a sample whose prompt is longer
than ``max_prompt_length`` is **dropped** (``dropped_long_prompt``). verl's agent loop
left-truncates instead, but a cut prompt is not what the engine conditioned on, so its log-probs
and reward would be wrong for it. A response longer than ``max_response_length`` is **truncated**
(``truncated_response``), with its mask, log-probs and reward placement cut the same way.

Teams: verl trains one model (one adapter) per job, so ``to_dataprotos(samples, policies=[...])``
gives one batch per policy (routed by served name, ``route_by_policy``); each goes to the verl job
(or the alternating step) that trains that policy. docs/verl.md says how.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import ConfigurationError
from ...records import Sample
from ...store.training_samples import SampleStats, group_keys, route_by_policy


def _verl():
    try:
        import numpy as np
        import torch
        from verl import DataProto
    except ImportError as exc:
        raise ImportError("the verl bridge needs verl: pip install 'lightning-rl[verl]'") from exc
    return np, torch, DataProto


def to_dataproto(samples: Sequence[Sample], *, pad_token_id: int, max_prompt_length: int, max_response_length: int,
                 temperature: float = 1.0, use_token_rewards: bool = False) -> Any:
    np, torch, DataProto = _verl()
    if max_prompt_length < 1 or max_response_length < 1:
        raise ConfigurationError(
            f"max_prompt_length and max_response_length must be positive, got {max_prompt_length}, {max_response_length}")
    metrics = {"samples_in": len(samples), "dropped_long_prompt": 0, "dropped_empty_response": 0, "truncated_response": 0}
    kept: list[Sample] = []
    for s in samples:
        if len(s.prompt_ids) > max_prompt_length:
            metrics["dropped_long_prompt"] += 1
        elif not s.response_ids:
            metrics["dropped_empty_response"] += 1
        else:
            if len(s.response_ids) > max_response_length:
                metrics["truncated_response"] += 1
            kept.append(s)
    if not kept:
        raise ConfigurationError(f"no sample fits (prompt <= {max_prompt_length} tokens, non-empty response): {metrics}")
    n, P, R = len(kept), max_prompt_length, max_response_length
    prompts = torch.full((n, P), pad_token_id, dtype=torch.long)
    responses = torch.full((n, R), pad_token_id, dtype=torch.long)
    prompt_attn = torch.zeros((n, P), dtype=torch.long)
    response_attn = torch.zeros((n, R), dtype=torch.long)
    response_mask = torch.zeros((n, R), dtype=torch.long)
    rm_scores = torch.zeros((n, R), dtype=torch.float32)
    with_logprobs = all(s.rollout_logprobs is not None for s in kept)
    logprobs = torch.zeros((n, R), dtype=torch.float32)
    for i, s in enumerate(kept):
        p = len(s.prompt_ids)
        prompts[i, P - p:] = torch.tensor(s.prompt_ids)
        prompt_attn[i, P - p:] = 1
        r = min(len(s.response_ids), R)
        responses[i, :r] = torch.tensor(s.response_ids[:r])
        response_attn[i, :r] = 1
        mask = torch.tensor(s.response_mask[:r], dtype=torch.long)
        response_mask[i, :r] = mask
        if with_logprobs:
            logprobs[i, :r] = torch.tensor(s.rollout_logprobs[:r], dtype=torch.float32) * mask
        if use_token_rewards and s.token_rewards is not None and len(s.token_rewards) == len(s.response_ids):
            rm_scores[i, :r] = torch.tensor(s.token_rewards[:r], dtype=torch.float32)
            if r < len(s.response_ids):  # rewards past the cut land on the last kept token
                rm_scores[i, r - 1] += float(sum(s.token_rewards[r:]))
        else:
            rm_scores[i, r - 1] = float(s.reward or 0.0)
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "rm_scores": rm_scores,
    }
    if with_logprobs:
        tensors["rollout_log_probs"] = logprobs
    empty = np.empty(n, dtype=object)
    empty[:] = [{} for _ in range(n)]
    non_tensors = {
        "uid": np.array(group_keys(kept), dtype=object),
        "agent_name": np.array([s.agent_name or "" for s in kept], dtype=object),
        "policy": np.array([s.policy or "" for s in kept], dtype=object),
        "policy_version": np.array([-1 if s.policy_version is None else s.policy_version for s in kept], dtype=object),
        "rollout_id": np.array([s.rollout_id or "" for s in kept], dtype=object),
        "multi_modal_inputs": empty,
    }
    metrics["samples_out"] = n
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors,
                               meta_info={"temperature": temperature, "lightning_rl_metrics": metrics})


def to_dataprotos(samples: Sequence[Sample], *, policies: Sequence[str], **kwargs: Any) -> dict[str, Any]:
    """One ``DataProto`` per policy (served name) that has samples, as :func:`to_dataproto` makes it
    (same keyword arguments). Samples served under a name not in ``policies`` are left out and
    counted: ``samples_unrouted`` in every batch's ``lightning_rl_metrics``."""
    stats = SampleStats()
    routed = route_by_policy(samples, policies, stats)
    batches = {name: to_dataproto(found, **kwargs) for name, found in routed.items() if found}
    for batch in batches.values():
        batch.meta_info["lightning_rl_metrics"]["samples_unrouted"] = stats.unrouted
    return batches
