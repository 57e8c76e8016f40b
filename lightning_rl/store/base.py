"""The Store: the sink the tracer writes to, plus queries, late rewards, trajectories and samples.

Implementations provide the storage primitives (the ``_``-prefixed methods and the sink methods);
everything users call is written once here, so every store behaves the same.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import orjson
from pydantic import ValidationError

from .. import semconv
from ..boundaries import check_int, json_problem
from ..diagnostics import count
from ..errors import ConfigurationError, RolloutNotFoundError, check_reward, shown
from ..records import (
    Mode,
    PolicyRecord,
    QuarantinedRecord,
    QueueEntry,
    Reward,
    RewardSource,
    Rollout,
    RolloutPage,
    RolloutQuery,
    RolloutRow,
    RolloutStatus,
    Sample,
    Span,
    Trajectory,
)
from ..settings import check_mode
from . import task_queue
from .assembly import assemble
from .samples import SampleStats, trajectory_samples


def _since(value: float | dt.datetime | None) -> float | None:
    if value is None or isinstance(value, (int, float)):
        return value
    if isinstance(value, dt.datetime):
        return value.timestamp()
    raise ConfigurationError(f"since must be a UNIX time or a datetime, got {shown(value)}")


def check_count(value: Any, name: str, *, minimum: int = 0, optional: bool = False) -> None:
    """A count, position or version a caller passes: an int from ``minimum`` to 2**63-1 (SQLite's range)."""
    check_int(value, name, minimum=minimum, optional=optional)


def check_position(after: Any) -> None:
    check_int(after, "after", meaning="a position returned by rewarded_since")


def page_matches(query: RolloutQuery, row: RolloutRow) -> bool:
    r = row.rollout
    if any(want is not None and have != want for want, have in (
            (query.mode, r.mode), (query.status, r.status), (query.agent, r.agent), (query.group_id, r.group_id),
            (query.policy_version, r.policy_version))):
        return False
    if (query.reward_min is not None or query.reward_max is not None) and row.reward is None:
        return False
    if query.reward_min is not None and row.reward < query.reward_min:
        return False
    if query.reward_max is not None and row.reward > query.reward_max:
        return False
    if query.text:
        task = orjson.dumps(r.task).decode() if r.task is not None else ""
        text = query.text.lower()  # as SQLite's LIKE: ASCII letters in any case
        if text not in task.lower() and text not in r.rollout_id.lower():
            return False
    return True


def page_sort_key(query: RolloutQuery, row: RolloutRow) -> tuple:
    value = row.reward if query.sort == "reward" else getattr(row.rollout, query.sort)
    return (value is None, "" if value is None else value, row.rollout.start_time)


class Store:
    """Base of every store. Subclasses implement the primitives below."""

    url: str = ""

    # -- primitives (subclasses) -----------------------------------------------------------------
    def _get_rollout(self, rollout_id: str) -> Rollout | None:
        raise NotImplementedError

    def _query_rollouts(
        self, *, mode: str | None, status: str | None, since: float | None,
        min_policy_version: int | None, limit: int | None, newest_first: bool,
    ) -> list[Rollout]:
        raise NotImplementedError

    def _get_spans(self, rollout_id: str) -> list[Span]:
        raise NotImplementedError

    def _get_rewards(self, rollout_id: str) -> list[Reward]:
        raise NotImplementedError

    def _insert_reward(self, reward: Reward) -> None:
        raise NotImplementedError

    def _queue_txn(self, fn):  # fn(view: task_queue.QueueView) -> T, run atomically
        raise NotImplementedError

    def _insert_policy(self, record: PolicyRecord) -> None:  # durable on return
        raise NotImplementedError

    def _query_policies(self, served_name: str | None, latest: bool = False) -> list[PolicyRecord]:
        """In publish order; ``latest``: only the last publish of each name."""
        raise NotImplementedError

    def _rewards_after(self, after: int, name: str | None, limit: int) -> list[tuple[int, str]]:
        """``(position, rollout_id)`` of rewards stored after position ``after``, in order."""
        raise NotImplementedError

    def _quarantined(self, limit: int) -> list[QuarantinedRecord]:
        """The records set aside because they could not be written, newest first."""
        raise NotImplementedError

    def _writable(self, what: str) -> None:
        """Raise :class:`StoreError` when this store was opened read-only (``what`` names the call)."""

    def write_batch(self, items: list[tuple[str, Any]]) -> None:
        """Write validated items (``rollout``, ``span_values``, ``reward``, ``finish``) idempotently;
        durable on return. The store server's write path."""
        raise NotImplementedError

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API --------------------------------------------------------------------------------
    def get_rollout(self, rollout_id: str) -> Rollout:
        rollout = self._get_rollout(rollout_id)
        if rollout is None:
            raise RolloutNotFoundError(
                f"no rollout {shown(rollout_id)} in {self.url}; list ids with `lightning-rl rollouts ls`"
            )
        return rollout

    def rollout_page(self, query: RolloutQuery | None = None, **filters: Any) -> RolloutPage:
        """One page of rollouts, filtered and sorted (``RolloutQuery``; keyword filters build one)."""
        if query is None:
            try:
                query = RolloutQuery(**filters)
            except ValidationError as exc:
                raise ConfigurationError(f"bad rollout query: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
        return self._rollout_page(query)

    def _rollout_page(self, query: RolloutQuery) -> RolloutPage:
        """Any store: filter and sort in Python (the SQLite store does it in SQL)."""
        rows = []
        for rollout in self._query_rollouts(mode=None, status=None, since=None, min_policy_version=None, limit=None,
                                            newest_first=False):
            values = [r.value for r in self._get_rewards(rollout.rollout_id) if r.name == "reward"]
            row = RolloutRow(rollout=rollout, reward=sum(values) if values else None, rewards=len(values))
            if page_matches(query, row):
                rows.append(row)
        rows.sort(key=lambda row: page_sort_key(query, row), reverse=query.descending)
        rows.sort(key=lambda row: page_sort_key(query, row)[0])  # no value (no reward, no agent) last, either way
        return RolloutPage(rows=rows[query.offset:query.offset + query.limit], total=len(rows))

    def rollouts(
        self,
        *,
        mode: str | None = None,
        status: str | RolloutStatus | None = None,
        since: float | dt.datetime | None = None,
        min_policy_version: int | None = None,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[Rollout]:
        if mode is not None:
            check_mode(mode)
        check_count(min_policy_version, "min_policy_version", optional=True)
        check_count(limit, "limit", optional=True)
        if status is not None:
            try:
                status = RolloutStatus(status).value
            except ValueError:
                raise ConfigurationError(
                    f"status {status!r} is not one of {', '.join(s.value for s in RolloutStatus)}"
                ) from None
        return self._query_rollouts(
            mode=mode, status=status, since=_since(since), min_policy_version=min_policy_version,
            limit=limit, newest_first=newest_first,
        )

    def resolve_rollout_id(self, prefix: str) -> str:
        """The rollout id that ``prefix`` names: itself, or the one id that starts with it (listings and
        logs show 12 characters). Several: a :class:`ConfigurationError` naming them; none: not found."""
        if not isinstance(prefix, str) or not prefix:
            raise ConfigurationError(f"a rollout id (or its first characters) is a non-empty string, got {shown(prefix)}")
        if self._get_rollout(prefix) is not None:
            return prefix
        found = self._rollout_ids_with_prefix(prefix, 11)
        if len(found) == 1:
            return found[0]
        if not found:
            raise RolloutNotFoundError(
                f"no rollout {shown(prefix)} (nor one starting with it) in {self.url}; list ids with "
                "`lightning-rl rollouts ls`")
        more = "" if len(found) <= 10 else ", ..."
        raise ConfigurationError(f"{shown(prefix)} starts {len(found) if len(found) <= 10 else 'more than 10'} rollout "
                                 f"ids: {', '.join(found[:10])}{more}; give more of it")

    def _rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        """Up to ``limit`` rollout ids starting with ``prefix``, in order. Any store: a scan."""
        ids = sorted(r.rollout_id for r in self._query_rollouts(mode=None, status=None, since=None,
                                                                min_policy_version=None, limit=None, newest_first=False))
        return [rid for rid in ids if rid.startswith(prefix)][:limit]

    def llm_call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """How many LLM calls each rollout recorded (a finished rollout with none trains nothing)."""
        counts = {}
        for rollout, spans, _ in self._with_data([r for rid in rollout_ids if (r := self._get_rollout(rid))]):
            counts[rollout.rollout_id] = sum(1 for s in spans if isinstance(op := s.attributes.get(
                semconv.GEN_AI_OPERATION_NAME), str) and op in semconv.LLM_OPERATIONS)
        return counts

    def spans(self, rollout_id: str) -> list[Span]:
        self.get_rollout(rollout_id)
        return self._get_spans(rollout_id)

    def rewards(self, rollout_id: str) -> list[Reward]:
        self.get_rollout(rollout_id)
        return self._get_rewards(rollout_id)

    def quarantined(self, *, limit: int = 1000) -> list[QuarantinedRecord]:
        """Records this store set aside because they could not be written (a value SQLite cannot hold,
        a spill line of another version), newest first, each with its reason and original form. The rest
        of their batches was written; ``lightning-rl store doctor`` shows them."""
        check_count(limit, "limit")
        return self._quarantined(limit)

    def expire_idle_running(self, idle_seconds: float, *, origin: str | None = None,
                            keep: Collection[str] = (), now: float | None = None) -> list[str]:
        """End as ``timed_out`` the running rollouts (of ``origin``, or any) that nothing reached for
        ``idle_seconds``: no span ended, no reward came, since then (or since they started). Their opener
        died without ending them (a gateway or a process killed outright), so they would read "running"
        for ever. ``keep``: ids a live opener still holds. Returns the ids ended; records nothing else."""
        if not (isinstance(idle_seconds, (int, float)) and idle_seconds > 0):
            raise ConfigurationError(f"idle_seconds must be a number of seconds > 0, got {idle_seconds!r}")
        now = time.time() if now is None else now
        candidates = [r for r in self.rollouts(status=RolloutStatus.RUNNING)
                      if (origin is None or r.origin == origin) and r.rollout_id not in keep
                      and now - r.start_time >= idle_seconds]
        ended = []
        for rollout in candidates:
            if now - self._last_activity(rollout) < idle_seconds:
                continue
            self.finish_rollout(rollout.rollout_id, RolloutStatus.TIMED_OUT, now,
                                f"nothing reached this rollout for {idle_seconds:g} s and its opener "
                                f"({rollout.origin or 'a traced function'}) no longer holds it: it stopped without "
                                "ending it")
            ended.append(rollout.rollout_id)
        if ended:
            self.flush()
            count("rollouts_expired_idle", len(ended))
        return ended

    def _last_activity(self, rollout: Rollout) -> float:
        """When anything last reached ``rollout``: its start, its last span's end, its last reward (epoch s).
        Any store, from the records; the SQLite store asks SQL for the two maxima instead."""
        spans, rewards = self._get_spans(rollout.rollout_id), self._get_rewards(rollout.rollout_id)
        return max([rollout.start_time, *(s.end_ns / 1e9 for s in spans), *(r.time for r in rewards)])

    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]:
        return {rid for rid in rollout_ids if self._get_rollout(rid) is not None}

    def rollout_data(self, rollout_ids: Sequence[str]) -> list[tuple[Rollout, list[Span], list[Reward]]]:
        """Each rollout with its spans and rewards (unknown ids raise :class:`RolloutNotFoundError`)."""
        return list(self._with_data([self.get_rollout(rid) for rid in rollout_ids]))

    def _with_data(self, rollouts: Iterable[Rollout]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        for rollout in rollouts:
            yield rollout, self._get_spans(rollout.rollout_id), self._get_rewards(rollout.rollout_id)

    def add_reward(
        self,
        rollout_id: str,
        value: float,
        name: str = "reward",
        *,
        llm_call_index: int | None = None,
        agent: str | None = None,
        source: str | RewardSource = RewardSource.FEEDBACK,
        uid: str | None = None,
    ) -> Reward:
        """Attach a reward to a rollout, also long after it ended (user feedback). Durable on return.
        Give ``uid`` to make a retried call idempotent (the same uid is stored once)."""
        self._writable("add_reward")
        value = check_reward(value, what=f"reward {name!r}")
        check_count(llm_call_index, "llm_call_index", optional=True)
        self.flush()  # a rollout that just finished in this process must be visible
        self.get_rollout(rollout_id)
        reward = Reward(
            rollout_id=rollout_id, value=value, name=name, llm_call_index=llm_call_index,
            agent=agent, source=RewardSource(source), **({"uid": uid} if uid else {}),
        )
        self._insert_reward(reward)
        return reward

    def rewarded_since(self, after: int = 0, *, name: str | None = None, limit: int = 10_000) -> tuple[list[str], int]:
        """Rollouts that got a reward (named ``name``, or any) since position ``after``, and the
        position to pass next time: a poller reads what is new, not the store's history."""
        check_position(after)
        check_count(limit, "limit")
        rows = self._rewards_after(after, name, limit)
        ids = list(dict.fromkeys(rid for _, rid in rows))
        return ids, (rows[-1][0] if rows else after)

    # -- policies: which weights each served name answers with ------------------------------------
    def record_policy(self, served_name: str, version: int, *, adapter: str | None = None,
                      time: float | None = None, trained_on: Sequence[str] | None = None) -> PolicyRecord:
        """Record a publish (trainers call it after the weights are live). Durable on return; every
        process that traces into this store stamps its LLM calls from these records. ``trained_on``:
        the group ids of the rollouts whose samples made this version, in batch order (its lineage)."""
        if not isinstance(served_name, str) or not served_name:
            raise ConfigurationError(f"served_name must be the model name agents request, got {shown(served_name)}")
        check_count(version, "policy version")
        if trained_on is not None:
            if not isinstance(trained_on, (list, tuple)):
                raise ConfigurationError(
                    f"trained_on must be a list of rollout group ids (or None), got {shown(trained_on)}")
            bad = [g for g in trained_on if not isinstance(g, str) or not g]
            if bad:
                raise ConfigurationError(
                    f"trained_on must hold non-empty group id strings, got {shown(bad[0])} in {shown(trained_on)}")
            trained_on = list(trained_on)
        record = PolicyRecord(served_name=served_name, version=version, adapter=adapter, trained_on=trained_on,
                              **({"time": time} if time is not None else {}))
        self._insert_policy(record)
        return record

    def policies(self, served_name: str | None = None) -> list[PolicyRecord]:
        """Every recorded publish (of ``served_name``, or of all), oldest first."""
        return self._query_policies(served_name)

    def latest_policies(self) -> dict[str, PolicyRecord]:
        """The latest publish of each served name: what it answers with now."""
        return {p.served_name: p for p in self._query_policies(None, latest=True)}

    def policy_versions(self) -> dict[str, int]:
        """The version each served name answers with now."""
        return {name: p.version for name, p in self.latest_policies().items()}

    def trajectory(self, rollout_id: str, *, credit: str = "final", reward_name: str = "reward", **credit_kwargs: Any) -> Trajectory:
        rollout = self.get_rollout(rollout_id)
        return assemble(
            rollout, self._get_spans(rollout_id), self._get_rewards(rollout_id),
            credit=credit, reward_name=reward_name, **credit_kwargs,
        )

    def trajectories(
        self,
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
        """Assembled trajectories, oldest first. ``agent`` keeps those in which that agent took part."""
        rollouts = self.rollouts(
            mode=mode, status=status, since=since, min_policy_version=min_policy_version, limit=limit
        )
        for rollout, spans, rewards in self._with_data(rollouts):
            traj = assemble(rollout, spans, rewards, credit=credit, reward_name=reward_name, **credit_kwargs)
            if agent is not None and agent not in traj.agents:
                continue
            yield traj

    # -- the task queue (rules in store/task_queue.py) --------------------------------------------
    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False) -> list[QueueEntry]:
        """Queue ``task`` to be tried ``n`` times (one group). Returns the new entries.

        ``once=True`` (with ``group_id``) makes it idempotent: if that group exists already, its
        entries are returned and nothing is added (a retried request after a lost answer)."""
        check_mode(mode)
        problem = json_problem(task, "task")
        if problem:
            raise ConfigurationError(f"the task cannot be stored: {problem}")
        check_count(max_tries, "max_tries", minimum=1)
        entries = task_queue.new_group(task, n, mode=mode, max_tries=max_tries, group_id=group_id)

        def put(view):
            if once and group_id is not None:
                existing = view.select(status=list(task_queue.QueueStatus), group_ids=[group_id])
                if existing:
                    return existing
            view.put(entries)
            return entries

        self._writable("enqueue")
        return self._queue_txn(put)

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None) -> list[QueueEntry]:
        """Lease up to ``limit`` entries to ``runner`` (expired leases are re-issued, see the rules).
        Asking again with the same ``key`` returns what that request leased (a retry after a lost answer)."""
        expired: list[QueueEntry] = []

        def expire(entry: QueueEntry, reason: str) -> None:
            self.expire_rollout(entry, reason)
            expired.append(entry)

        leased = self._queue_txn(
            lambda view: task_queue.lease(view, runner, lease_seconds, limit, time.time(), expire, key))
        if expired:
            self.flush()  # the expired tries read timed_out by the time their retries are handed out
        return leased

    def expire_rollout(self, entry: QueueEntry, reason: str) -> None:
        """The queue gave up on this try (its lease expired, or its runner stopped waiting): its rollout
        is ``timed_out`` whatever it reports, now or later. A rollout that has not started yet gets a
        ``timed_out`` row at once, so a late start cannot bring it back as a success outside the queue.
        (Stores whose rollouts live elsewhere send a plain finish.)"""
        self.finish_rollout(entry.rollout_id, RolloutStatus.TIMED_OUT, time.time(), reason)

    @staticmethod
    def _tombstone(entry: QueueEntry, reason: str) -> Rollout:
        now = time.time()
        return Rollout(rollout_id=entry.rollout_id, task=entry.task, group_id=entry.group_id, attempt=entry.attempt,
                       mode=entry.mode, status=RolloutStatus.TIMED_OUT, start_time=now, end_time=now, error=reason)

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0) -> bool:
        return self._queue_txn(lambda view: task_queue.heartbeat(view, queue_id, runner, lease_seconds, time.time()))

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str) -> bool:
        """Record a try's outcome, after the records written so far (an outcome never overtakes the
        rollout it reports on). False if ``runner`` no longer holds the lease (it expired)."""
        self.flush()
        return self._queue_txn(lambda view: task_queue.complete(view, queue_id, runner, outcome))

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        statuses = list(task_queue.QueueStatus)
        return self._queue_txn(lambda view: view.select(status=statuses, group_ids=group_ids))

    def wait_for_groups(self, group_ids: Sequence[str], *, timeout: float | None = None) -> bool:
        """Wait until every try of these groups is done; False on timeout."""
        left = task_queue.wait_until(lambda: self._queue_txn(lambda view: task_queue.pending(view, group_ids)),
                                     lambda n: n == 0, timeout)
        return left == 0

    def samples(
        self,
        *,
        level: str = "call",
        agents: str | Sequence[str] | None = None,
        include_unrewarded: bool = False,
        status: str | RolloutStatus | None = RolloutStatus.SUCCEEDED,
        **trajectory_filters: Any,
    ) -> tuple[list[Sample], SampleStats]:
        """Training samples from finished rollouts (succeeded ones by default; failed rollouts are
        never mixed in unless asked). Samples without a reward are skipped unless asked."""
        out: list[Sample] = []
        stats = SampleStats()
        for traj in self.trajectories(status=status, **trajectory_filters):
            samples, s = trajectory_samples(traj, level=level, agents=agents)
            for sample in samples:
                if sample.reward is None and not include_unrewarded:
                    s.skipped_unrewarded += 1
                    s.samples -= 1
                    continue
                out.append(sample)
            stats.add(s)
        return out, stats


__all__ = ["Store", "Mode"]
