"""From a batch of groups to the samples one update trains on, with everything left out counted.

``batch_samples``: each group's tries as samples; a try the model made fail is trained on with the
failure reward, a group hit by an infrastructure failure is left out whole (``failures.py``); the
counts go on the metrics line (outcomes, failures by kind, prefix splits, calls without engine token
ids, samples without a reward, rollouts that made no LLM call, and this process's records set aside).
``drop_stale``: samples too many versions behind the policy they train are dropped and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..diagnostics import counters
from ..records import Sample
from ..store.training_samples import SampleStats, trajectory_samples
from .failures import FailureCounts, failure_kind, with_failure_reward
from .sources import StepBatch

#: This process's counters of records set aside, put on every metrics line (cumulative): a record the store
#: quarantined, ops the store server refused, stored spans or rows the readers could not use, LLM calls
#: seen at the HTTP layer that bypassed the instrumented client, LLM calls whose token ids redaction dropped
#: (their text changed: not trained on) and texts a failing redaction function replaced.
SET_ASIDE = ("records_quarantined", "rejected_ops", "malformed_spans_skipped", "malformed_span_fields",
             "span_rows_unreadable", "rollout_rows_unreadable", "llm_calls_bypassing_capture",
             "redacted_token_ids_dropped", "redaction_failed")


def set_aside_counts() -> dict[str, int]:
    found = counters()
    return {name: found.get(name, 0) for name in SET_ASIDE}


def sandbox_counts() -> dict[str, int]:
    """This process's sandbox pools' counts (``lightning_rl.sandbox.SANDBOX_METRICS``, cumulative), without the
    ``sandbox_`` prefix: started, reused, failed to start, killed at the deadline, reset time."""
    from ..sandbox.pool import SANDBOX_METRICS

    found = counters()
    return {name.removeprefix("sandbox_"): found.get(name, 0) for name in SANDBOX_METRICS}


def batch_samples(batch: StepBatch, *, level: str, agents: str | Sequence[str] | None, infra_errors: Iterable[str],
                  failure_reward: float) -> tuple[list[Sample], list[float], dict[str, Any]]:
    """The samples of a batch's groups (failures handled as the module says), the reward of each
    trained rollout, and the counts for the metrics line."""
    failures, stats = FailureCounts(), SampleStats()
    samples: list[Sample] = []
    rewards: list[float] = []
    without_calls = 0
    for trajectories in batch.groups:
        without_calls += sum(1 for t in trajectories if not t.llm_calls)
        kinds = [failure_kind(t, infra_errors) for t in trajectories]
        if "infra" in kinds:
            failures.infra_failures += kinds.count("infra")
            failures.groups_dropped += 1
            failures.tries_dropped += len(trajectories)
            continue
        for traj, kind in zip(trajectories, kinds):
            found, s = trajectory_samples(traj, level=level, agents=agents)
            stats.add(s)
            if kind == "model":
                failures.model_failures += 1
                found = with_failure_reward(found, failure_reward)
                rewards.append(failure_reward)
            else:
                rewards.append(traj.final_reward or 0.0)
            for sample in found:
                if sample.reward is None:
                    stats.skipped_unrewarded += 1
                else:
                    samples.append(sample)
    counts = {"outcomes": dict(batch.outcomes), **failures.as_metrics(), "prefix_splits": stats.splits,
              "calls_without_engine_ids": stats.missing_token_ids, "unrewarded_samples": stats.skipped_unrewarded,
              "rollouts_without_llm_calls": without_calls, **set_aside_counts(), "sandbox": sandbox_counts()}
    return samples, rewards, counts


def drop_stale(samples: Sequence[Sample], versions: Mapping[str, int], max_staleness: int,
               serving: Callable[[Sample], str | None]) -> tuple[list[Sample], dict[str, Any]]:
    """Samples at most ``max_staleness`` versions behind the policy that served them (``serving``: the
    version their call was served by, from its span, against that policy's version now), and the
    counts: a histogram of versions behind, the samples dropped as too stale, and those whose call
    carried no version or went to a model this trainer does not publish (kept, not judged)."""
    kept: list[Sample] = []
    behind: dict[str, int] = {}
    dropped = unversioned = 0
    for sample in samples:
        policy = serving(sample)
        current = versions.get(policy) if policy is not None else None
        if current is None or sample.policy_version is None:
            unversioned += 1
            kept.append(sample)
            continue
        lag = current - sample.policy_version
        behind[str(lag)] = behind.get(str(lag), 0) + 1
        if lag > max_staleness:
            dropped += 1
        else:
            kept.append(sample)
    return kept, {"staleness": dict(sorted(behind.items(), key=lambda kv: int(kv[0]))),
                  "samples_dropped_stale": dropped, "samples_unversioned": unversioned}
