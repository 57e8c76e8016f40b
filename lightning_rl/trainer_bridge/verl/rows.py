"""verl rows from a finished rollout: one row per trained segment, with the weight versions verl reads.

``rollout_rows(traj, ...)`` turns one trajectory into the rows verl's agent loop hands its trainer (what
``AgentLoopOutput`` holds), without importing verl, so the rule is the same wherever it runs:

* **One row per segment.** A trajectory whose token prefix broke (a chat template re-rendered between turns,
  a reasoning model dropping old thinking, another agent or served name, a compacted context) is several
  trajectory-level samples; each becomes its own row, in order. verl's V1 trainer takes a list per try (its
  keys ``{uid}_{session}_{i}``) and copies the last row's ``reward_score`` over the earlier rows, so each row's
  own reward after credit travels in ``extra_fields["segment_reward"]``, which the trainer's advantage reads
  (``advantage.py``). A rollout with no usable call is one fully masked placeholder row.
* **Every row batches.** V1 takes rows unpadded (``agent_loop_tq._agent_loop_postprocess``), so a row keeps its
  whole prompt, however long: the context the engine conditioned on. A row that must not be trained on keeps
  its shape with its response mask all 0, and ``extra_fields["masked"]`` says why (``no_sample``,
  ``no_engine_logprobs``, ``infra_failure``, ``external_timeout``).
* **Failures** (``failures.failure_kind``): a try the model made fail is trained on with
  ``failure_reward`` on every segment; an infrastructure failure is a row without gradient, reward 0.0,
  ``extra_fields["failure"] == "infra"``, and the trainer leaves its whole GRPO group out of the batch
  (``advantage.py``), as the local trainer does.
* **Weight versions.** ``extra_fields["min_global_steps"]`` / ``["max_global_steps"]`` are the oldest and
  newest weight versions (verl's global steps) that generated the row, as verl's own
  ``LLMServerClient.generate`` sets them; V1 reads them every step (``np.array(..., dtype=int)``, so never
  None) for its off-policy metrics and ``max_off_policy_threshold``. They come from, in order: the versions
  the serving replica reported when the rollout began and ended (``versions``), else the versions stamped
  on the segment's calls (the store's publishes, which ``trainer`` records at every weight sync), else
  the step's own weights in V1's sync mode (``global_steps - 1``). ``extra_fields["version_source"]`` says
  which (``server``, ``calls``, ``step``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...records import Sample, Trajectory
from ...store.training_samples import trajectory_samples
from ..failures import INFRA_ERRORS, failure_kind


@dataclass(slots=True)
class Row:
    """One verl row: the fields of ``AgentLoopOutput``."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward_score: float
    num_turns: int
    extra_fields: dict[str, Any] = field(default_factory=dict)


def rollout_rows(traj: Trajectory, *, response_length: int, pad_token_id: int,
                 agents: str | Sequence[str] | None = None, failure_reward: float = 0.0,
                 infra_errors: Iterable[str] = INFRA_ERRORS, versions: tuple[int, int] | None = None,
                 global_steps: int | None = None, policy_version: int | None = None,
                 version_base: int = 0, mask_guided: bool = True) -> list[Row]:
    """The rows of one finished rollout (module doc). ``versions``: the replica's weight versions at the
    rollout's start and end, when known; ``global_steps``: the dataset step the row belongs to (verl's
    ``kwargs["global_steps"]``); ``policy_version``: what the rows report as the rollout's version;
    ``version_base``: the run's (``runs.py``): calls are stamped base + verl's global step; ``mask_guided``: a
    segment sampled under a grammar has no gradient (``lightning_rl.guided_decoding=mask``, the default)."""
    samples, stats = trajectory_samples(traj, level="trajectory", agents=agents)
    kind = failure_kind(traj, infra_errors)
    common: dict[str, Any] = {"rollout_id": traj.rollout_id, "prefix_splits": stats.splits,
                              "segments": max(len(samples), 1), "status": traj.status.value, "failure": kind or "",
                              "policy_version": policy_version, "reward_extra_info": {}}
    fixed = failure_reward if kind == "model" else 0.0 if kind == "infra" else None
    if not samples:  # nothing to train on: a fully masked placeholder verl can still batch
        first = traj.llm_calls[0].prompt_token_ids if traj.llm_calls and traj.llm_calls[0].prompt_token_ids else None
        extra = {**common, "segment": 0, **_versions(traj, [], versions, global_steps, version_base)}
        return [_row(first or [pad_token_id], [pad_token_id], [0], [0.0], fixed or 0.0, 0, extra, masked="no_sample")]
    rows = []
    for i, sample in enumerate(samples):
        reward = fixed if fixed is not None else float(sample.reward or 0.0)
        extra = {**common, "segment": i, **_versions(traj, sample.llm_call_indices, versions, global_steps, version_base)}
        guided = mask_guided and any(c.sampling_params.get("guided") for c in traj.llm_calls
                                     if c.index in set(sample.llm_call_indices))
        rows.append(_segment_row(sample, reward, extra, infra=kind == "infra", guided=guided,
                                 response_length=response_length))
    return rows


def _segment_row(sample: Sample, reward: float, extra: dict[str, Any], *, infra: bool, guided: bool,
                 response_length: int) -> Row:
    ids, mask = sample.response_ids[:response_length], sample.response_mask[:response_length]
    masked = "infra_failure" if infra else "guided_decoding" if guided else None
    logprobs = sample.rollout_logprobs[:response_length] if sample.rollout_logprobs is not None else None
    if logprobs is None or len(logprobs) != len(ids):
        logprobs, masked = [0.0] * len(ids), masked or "no_engine_logprobs"
    return _row(sample.prompt_ids, ids, mask, logprobs, reward, 2 * len(sample.llm_call_indices) + 1, extra,
                masked=masked)


def _row(prompt: list[int], ids: list[int], mask: list[int], logprobs: list[float], reward: float, turns: int,
         extra: dict[str, Any], *, masked: str | None) -> Row:
    if masked:  # the row keeps its shape, without gradient (its context or its log-probs are not the engine's)
        mask = [0] * len(ids)
    extra["masked"] = masked or ""
    extra["segment_reward"] = float(reward)  # verl overwrites reward_score of all but the last row
    return Row(list(prompt), list(ids), list(mask), list(logprobs), float(reward), turns, extra)


def _versions(traj: Trajectory, indices: Sequence[int], versions: tuple[int, int] | None,
              global_steps: int | None, base: int) -> dict[str, Any]:
    if versions is not None:
        return {"min_global_steps": int(versions[0]), "max_global_steps": int(versions[1]), "version_source": "server"}
    stamped = [c.policy_version - base for c in traj.llm_calls  # back to verl's global steps
               if c.index in set(indices) and c.policy_version is not None and c.policy_version >= base]
    if stamped:
        return {"min_global_steps": min(stamped), "max_global_steps": max(stamped), "version_source": "calls"}
    step = max(int(global_steps or 1) - 1, 0)  # V1 sync: a step's rollouts run on the weights synced after the last
    return {"min_global_steps": step, "max_global_steps": step, "version_source": "step"}


def segment_counts(rows: Sequence[Row]) -> dict[str, int]:
    """What one try's rows hold, for the metrics: segments, masked rows by reason."""
    counts = {"segments": len(rows)}
    for row in rows:
        if row.extra_fields.get("masked"):
            key = f"rows_masked_{row.extra_fields['masked']}"
            counts[key] = counts.get(key, 0) + 1
    return counts
