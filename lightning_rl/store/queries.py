"""What is derived from a store's records, written once over the protocol each needs: trajectories and
training samples from a ``RolloutReader``, rollout ids from a prefix, the sweep of rollouts nobody ended,
waiting for a queue's groups, the versions policies answer with.

    from lightning_rl import open_store, samples, trajectories

    with open_store("runs.db") as store:
        for traj in trajectories(store, mode="train", status="succeeded"):
            ...
        batch, stats = samples(store, level="trajectory")
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Protocol

from ..diagnostics import count
from ..errors import ConfigurationError, RolloutNotFoundError, shown
from ..records import RolloutStatus, Sample, Trajectory
from .assembly import assemble
from .checks import check_idle_seconds
from .protocols import PolicyLog, RolloutIndex, RolloutReader, SpanSink, TaskQueue
from .task_queue import wait_until
from .training_samples import SampleStats, trajectory_samples


def trajectory(reader: RolloutReader, rollout_id: str, *, credit: str = "final", reward_name: str = "reward",
               **credit_kwargs: Any) -> Trajectory:
    """One rollout assembled: its LLM calls in order with their credited rewards (``credit``: a rule of
    ``store/credit.py``; ``reward_name``: the reward that is final, e.g. ``user_feedback``)."""
    ((rollout, spans, rewards),) = reader.rollout_data([rollout_id])
    return assemble(rollout, spans, rewards, credit=credit, reward_name=reward_name, **credit_kwargs)


def trajectories(
    reader: RolloutReader,
    *,
    mode: str | None = None,
    since: float | dt.datetime | None = None,
    min_policy_version: int | None = None,
    agent: str | None = None,
    status: str | RolloutStatus | None = None,
    credit: str = "final",
    reward_name: str = "reward",
    limit: int | None = None,
    **credit_kwargs: Any,
) -> Iterator[Trajectory]:
    """Assembled trajectories, oldest first, read as you iterate. ``agent`` keeps those in which that
    agent took part; the other filters are ``RolloutReader.rollouts``'."""
    rollouts = reader.rollouts(mode=mode, status=status, since=since, min_policy_version=min_policy_version,
                               limit=limit)
    for rollout, spans, rewards in reader.rollout_data([r.rollout_id for r in rollouts]):
        traj = assemble(rollout, spans, rewards, credit=credit, reward_name=reward_name, **credit_kwargs)
        if agent is not None and agent not in traj.agents:
            continue
        yield traj


def samples(
    reader: RolloutReader,
    *,
    level: str = "call",
    agents: str | Sequence[str] | None = None,
    include_unrewarded: bool = False,
    status: str | RolloutStatus | None = RolloutStatus.SUCCEEDED,
    **trajectory_filters: Any,
) -> tuple[list[Sample], SampleStats]:
    """Training samples from finished rollouts (succeeded ones by default; failed rollouts are never mixed
    in unless asked). ``level``: ``call`` or ``trajectory`` (``training_samples.py``); ``agents``: names, or
    a regex of names, to keep. Samples without a reward are skipped (and counted) unless asked."""
    out: list[Sample] = []
    stats = SampleStats()
    for traj in trajectories(reader, status=status, **trajectory_filters):
        found, s = trajectory_samples(traj, level=level, agents=agents)
        for sample in found:
            if sample.reward is None and not include_unrewarded:
                s.skipped_unrewarded += 1
                s.samples -= 1
                continue
            out.append(sample)
        stats.add(s)
    return out, stats


class _ReaderWithIndex(RolloutReader, RolloutIndex, Protocol):
    """A reader that also answers index questions (every store)."""


def resolve_rollout_id(store: _ReaderWithIndex, prefix: str) -> str:
    """The rollout id that ``prefix`` names: itself, or the one id that starts with it (listings and logs
    show 12 characters). Several: a :class:`ConfigurationError` naming them; none: not found."""
    if not isinstance(prefix, str) or not prefix:
        raise ConfigurationError(f"a rollout id (or its first characters) is a non-empty string, got {shown(prefix)}")
    if store.existing_rollout_ids([prefix]):
        return prefix
    found = store.rollout_ids_with_prefix(prefix, 11)
    if len(found) == 1:
        return found[0]
    if not found:
        raise RolloutNotFoundError(f"no rollout {shown(prefix)} (nor one starting with it) in {store.url}; list ids "
                                   "with `lightning-rl rollouts ls`")
    more = "" if len(found) <= 10 else ", ..."
    raise ConfigurationError(f"{shown(prefix)} starts {len(found) if len(found) <= 10 else 'more than 10'} rollout "
                             f"ids: {', '.join(found[:10])}{more}; give more of it")


class _SweptStore(SpanSink, RolloutReader, RolloutIndex, Protocol):
    """What the idle sweep needs: the running rollouts, their last activity, and finishing them."""


def expire_idle_running(store: _SweptStore, idle_seconds: float, *, origin: str | None = None,
                        keep: Collection[str] = (), now: float | None = None) -> list[str]:
    """End as ``timed_out`` the running rollouts (of ``origin``, or any) that nothing reached for
    ``idle_seconds``: no span ended, no reward came, since then (or since they started). Their opener died
    without ending them (a gateway or a process killed outright), so they would read "running" for ever.
    ``keep``: ids a live opener still holds. Returns the ids ended; records nothing else."""
    check_idle_seconds(idle_seconds)
    now = time.time() if now is None else now
    candidates = [r for r in store.rollouts(status=RolloutStatus.RUNNING)
                  if (origin is None or r.origin == origin) and r.rollout_id not in keep
                  and now - r.start_time >= idle_seconds]
    ended = []
    for rollout in candidates:
        last = store.last_activity(rollout.rollout_id)
        if now - max(rollout.start_time, last or 0.0) < idle_seconds:
            continue
        store.finish_rollout(rollout.rollout_id, RolloutStatus.TIMED_OUT, now,
                             f"nothing reached this rollout for {idle_seconds:g} s and its opener "
                             f"({rollout.origin or 'a traced function'}) no longer holds it: it stopped without "
                             "ending it")
        ended.append(rollout.rollout_id)
    if ended:
        store.flush()
        count("rollouts_expired_idle", len(ended))
    return ended


def wait_for_groups(queue: TaskQueue, group_ids: Sequence[str], *, timeout: float | None = None,
                    poll: float = 0.1) -> bool:
    """Wait until every try of these groups is done or cancelled (polling every ``poll`` s); False on timeout."""
    def pending() -> int:
        return sum(1 for e in queue.queue_entries(group_ids) if not e.status.finished)

    return wait_until(pending, lambda n: n == 0, timeout, poll=poll) == 0


def policy_versions(log: PolicyLog) -> dict[str, int]:
    """The version each served name answers with now."""
    return {name: p.version for name, p in log.latest_policies().items()}
