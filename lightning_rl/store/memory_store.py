"""InMemoryStore: the same contract as SQLiteStore, kept in memory (tests, quick experiments).

Writes are the writer's ops (``store/ops.py``), applied at once under a lock; what a SQLite store could
not hold is quarantined here too (one contract). Index questions and the rollout page are answered by
a scan (``store/scan.py``).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..diagnostics import count
from ..records import (
    PolicyDecision,
    PolicyRecord,
    QuarantinedRecord,
    QueueEntry,
    QueueStatus,
    Reward,
    RewardSource,
    Rollout,
    RolloutPage,
    RolloutQuery,
    RolloutStatus,
    Span,
    SpanRow,
    allowed_from,
)
from . import checks, scan, task_queue
from .erasure import erased, rollout_id_list
from .ops import (
    EncodedSpan,
    ExpireTry,
    FinishRollout,
    Op,
    Quarantine,
    StartRollout,
    TracedSpan,
    WriteReward,
)
from .quarantine import describe, record_problem
from .rows import span_from_values, span_record_values, span_values


class InMemoryStore:
    """A store in this process's memory (every protocol of ``store/protocols.py``)."""

    def __init__(self) -> None:
        self.url = "memory://"
        self.read_only = False
        self._lock = threading.Lock()
        self._rollouts: dict[str, Rollout] = {}
        self._spans: dict[str, dict[int, Span]] = {}
        self._rewards: dict[str, list[Reward]] = {}
        self._reward_uids: set[str] = set()
        self._reward_log: list[tuple[str | None, str | None]] = []  # (rollout_id, name) in arrival order
        self._policies: list[PolicyRecord] = []
        self._decisions: list[PolicyDecision] = []
        self._queue: dict[str, QueueEntry] = {}
        self._qlock = threading.Lock()
        self._bell = task_queue.Bell()  # rung by enqueues: waiting leases wake at once
        self._quarantine: list[QuarantinedRecord] = []

    # -- writes: every op applied at once -------------------------------------------------------------
    def _apply(self, op: Op) -> None:
        problem = record_problem(op)
        if problem:  # what a SQLite store could not hold is set aside here too: one contract
            self._set_aside(describe(op, ValueError(problem)))
            return
        kind = type(op)
        if kind is TracedSpan or kind is EncodedSpan:
            # the same row round trip as the SQLite store (messages lifted, tokens packed)
            span = span_from_values(span_values(op.row) if kind is TracedSpan else op.values)
            with self._lock:
                self._spans.setdefault(span.rollout_id, {}).setdefault(span.seq, span)
        elif kind is StartRollout:
            with self._lock:
                self._rollouts.setdefault(op.rollout.rollout_id, op.rollout.model_copy())
        elif kind is WriteReward:
            self._add_reward(op.reward)
        elif kind is FinishRollout:
            self._finish(op)
        elif kind is ExpireTry:
            self._expire(op.tombstone)
        elif kind is Quarantine:
            self._set_aside(op)
        else:
            raise TypeError(f"not a writer op: {op!r:.80}")

    def _add_reward(self, reward: Reward) -> None:
        with self._lock:
            if reward.uid in self._reward_uids:
                return
            self._reward_uids.add(reward.uid)
            self._reward_log.append((reward.rollout_id, reward.name))
            self._rewards.setdefault(reward.rollout_id, []).append(reward)

    def _finish(self, op: FinishRollout) -> None:
        with self._lock:
            rollout = self._rollouts.get(op.rollout_id)
            if rollout is None or rollout.status not in allowed_from(op.status):
                count("rejected_status_transitions")
                return
            self._rollouts[op.rollout_id] = rollout.model_copy(update={
                "status": RolloutStatus(op.status), "end_time": op.end_time, "error": op.error,
                "policy_version": rollout.policy_version if op.policy_version is None else op.policy_version})

    def _expire(self, tombstone: Rollout) -> None:
        with self._lock:
            rollout = self._rollouts.setdefault(tombstone.rollout_id, tombstone)
            if rollout.status != RolloutStatus.TIMED_OUT:
                self._rollouts[tombstone.rollout_id] = rollout.model_copy(update={
                    "status": RolloutStatus.TIMED_OUT, "end_time": tombstone.end_time, "error": tombstone.error})

    def _set_aside(self, note: Quarantine) -> None:
        with self._lock:
            self._quarantine.append(QuarantinedRecord(
                quarantine_id=len(self._quarantine) + 1, time=time.time(), kind=note.what, rollout_id=note.rollout_id,
                reason=note.reason, payload=note.payload))
        count("records_quarantined")

    # -- SpanSink -------------------------------------------------------------------------------------
    def start_rollout(self, rollout: Rollout) -> None:
        self._apply(StartRollout(rollout))

    def write_span(self, row: SpanRow) -> None:
        self._apply(TracedSpan(row))

    def write_reward(self, reward: Reward) -> None:
        self._apply(WriteReward(reward))

    def finish_rollout(self, rollout_id: str, status: RolloutStatus, end_time: float, error: str | None,
                       policy_version: int | None = None) -> None:
        self._apply(FinishRollout(rollout_id, RolloutStatus(status), end_time, error, policy_version))

    def flush(self, timeout: float | None = None) -> bool:
        return True

    # -- ingest, quarantine, closing -----------------------------------------------------------------
    def add_spans(self, spans: list[Span]) -> None:
        for span in spans:
            self._apply(EncodedSpan(span_record_values(span)))

    def write_batch(self, ops: list[Op]) -> None:
        for op in ops:
            self._apply(op)

    def delete_rollouts(self, rollout_ids: Iterable[str], *, full: bool = False) -> int:
        ids = set(rollout_id_list(rollout_ids))
        with self._lock:
            removed = sum(self._rollouts.pop(rid, None) is not None for rid in ids)
            for rid in ids:
                self._spans.pop(rid, None)
                for reward in self._rewards.pop(rid, []):
                    self._reward_uids.discard(reward.uid)
            # positions stay where they were (a poller's next position is one of them); erased ones read as nothing
            self._reward_log = [(rid, name) if rid not in ids else (None, None) for rid, name in self._reward_log]
            self._quarantine = [q for q in self._quarantine if q.rollout_id not in ids]
        with self._qlock:
            for queue_id in [q for q, e in self._queue.items() if e.rollout_id in ids]:
                del self._queue[queue_id]
        return erased(removed)

    def quarantined(self, *, limit: int = 1000) -> list[QuarantinedRecord]:
        checks.check_count(limit, "limit")
        with self._lock:
            return list(reversed(self._quarantine))[:limit]

    def close(self) -> None:
        pass

    def __enter__(self) -> "InMemoryStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RolloutReader ------------------------------------------------------------------------------
    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._lock:
            rollout = self._rollouts.get(rollout_id)
        if rollout is None:
            raise checks.not_found(rollout_id, self.url)
        return rollout

    def rollouts(self, *, mode: str | None = None, status: str | RolloutStatus | None = None,
                 since: float | dt.datetime | None = None, min_policy_version: int | None = None,
                 limit: int | None = None, newest_first: bool = False) -> list[Rollout]:
        mode, status, since = checks.rollout_filters(mode, status, since, min_policy_version, limit)
        with self._lock:
            rows = list(self._rollouts.values())  # insertion order = start order
        out = [
            r for r in rows
            if (mode is None or r.mode == mode)
            and (status is None or r.status == status)
            and (since is None or r.start_time >= since)
            and (min_policy_version is None or (r.policy_version is not None and r.policy_version >= min_policy_version))
        ]
        out.sort(key=lambda r: r.start_time, reverse=newest_first)
        return out[:limit] if limit is not None else out

    def rollout_page(self, query: RolloutQuery | None = None, **filters: Any) -> RolloutPage:
        query = checks.rollout_query(query, filters)
        with self._lock:
            data = [(r, list(self._rewards.get(r.rollout_id, []))) for r in self._rollouts.values()]
        data.sort(key=lambda item: item[0].start_time)
        return scan.rollout_page(data, query)

    def _spans_of(self, rollout_id: str) -> list[Span]:
        with self._lock:
            spans = self._spans.get(rollout_id, {})
            return [spans[k] for k in sorted(spans)]

    def _rewards_of(self, rollout_id: str) -> list[Reward]:
        with self._lock:
            return list(self._rewards.get(rollout_id, []))

    def spans(self, rollout_id: str) -> list[Span]:
        self.get_rollout(rollout_id)
        return self._spans_of(rollout_id)

    def rewards(self, rollout_id: str) -> list[Reward]:
        self.get_rollout(rollout_id)
        return self._rewards_of(rollout_id)

    def rollout_data(self, rollout_ids: Sequence[str]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        for rollout_id in rollout_ids:
            rollout = self.get_rollout(rollout_id)
            yield rollout, self._spans_of(rollout_id), self._rewards_of(rollout_id)

    # -- RolloutIndex (scans) -----------------------------------------------------------------------
    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]:
        with self._lock:
            return {rid for rid in rollout_ids if rid in self._rollouts}

    def rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        with self._lock:
            ids = list(self._rollouts)
        return scan.ids_with_prefix(ids, prefix, limit)

    def llm_call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        return scan.llm_call_counts(self, rollout_ids)

    def last_activity(self, rollout_id: str) -> float | None:
        return scan.last_activity(self._spans_of(rollout_id), self._rewards_of(rollout_id))

    # -- RewardLog ----------------------------------------------------------------------------------
    def add_reward(self, rollout_id: str, value: float, name: str = "reward", *, llm_call_index: int | None = None,
                   agent: str | None = None, source: str | RewardSource = RewardSource.FEEDBACK,
                   uid: str | None = None) -> Reward:
        reward = checks.new_reward(rollout_id, value, name, llm_call_index=llm_call_index, agent=agent, source=source,
                                   uid=uid)
        self.get_rollout(rollout_id)
        self._apply(WriteReward(reward))
        return reward

    def rewarded_since(self, after: int = 0, *, name: str | None = None, limit: int = 10_000) -> tuple[list[str], int]:
        checks.check_position(after)
        checks.check_count(limit, "limit")
        with self._lock:
            log = self._reward_log[after:]
        rows = [(after + i + 1, rid) for i, (rid, n) in enumerate(log)
                if rid is not None and (name is None or n == name)][:limit]
        return list(dict.fromkeys(rid for _, rid in rows)), (rows[-1][0] if rows else after)

    # -- TaskQueue ----------------------------------------------------------------------------------
    def _queue_txn(self, fn):
        with self._qlock:
            return fn(_QueueView(self._queue))

    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False,
                overrides: Mapping[str, Any] | None = None) -> list[QueueEntry]:
        entries = task_queue.enqueue_in(self._queue_txn, task, n=n, mode=mode, max_tries=max_tries, group_id=group_id,
                                        once=once, overrides=overrides)
        self._bell.ring()  # waiting leases wake at once
        return entries

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None, wait: float = 0.0) -> list[QueueEntry]:
        def lease_now() -> list[QueueEntry]:
            return task_queue.lease_in(self._queue_txn, runner, lease_seconds=lease_seconds, limit=limit, key=key,
                                       expire_rollout=self.expire_rollout, flush=self.flush)

        return task_queue.lease_waiting(lease_now, wait, self._bell) if wait else lease_now()

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0) -> bool:
        return task_queue.heartbeat_in(self._queue_txn, queue_id, runner, lease_seconds)

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str) -> bool:
        return task_queue.complete_in(self._queue_txn, queue_id, runner, outcome)

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        return task_queue.entries_in(self._queue_txn, group_ids)

    def expire_rollout(self, entry: QueueEntry, reason: str) -> None:
        self._apply(ExpireTry(task_queue.tombstone(entry, reason)))

    # -- PolicyLog ----------------------------------------------------------------------------------
    def record_policy(self, served_name: str, version: int, *, adapter: str | None = None,
                      time: float | None = None, trained_on: Sequence[str] | None = None,
                      served_as: str | None = None) -> PolicyRecord:
        record = checks.policy_record(served_name, version, adapter=adapter, time=time, trained_on=trained_on,
                                      served_as=served_as)
        with self._lock:  # a copy: its trained_on list is nobody's but the store's, as in a file
            self._policies.append(record.model_copy(deep=True))
        return record

    def policies(self, served_name: str | None = None) -> list[PolicyRecord]:
        with self._lock:
            found = [p for p in self._policies if served_name is None or p.served_name == served_name]
        return [p.model_copy(deep=True) for p in found]

    def latest_policies(self) -> dict[str, PolicyRecord]:
        with self._lock:
            latest = {p.served_name: p for p in self._policies}
        return {name: p.model_copy(deep=True) for name, p in latest.items()}

    def record_decision(self, served_name: str, version: int, decision: str, *, live_version: int | None = None,
                        adapter: str | None = None, figures: Mapping[str, Any] | None = None,
                        reason: str | None = None, time: float | None = None) -> PolicyDecision:
        record = checks.decision_record(served_name, version, decision, live_version=live_version, adapter=adapter,
                                        figures=figures, reason=reason, time=time)
        with self._lock:
            self._decisions.append(record.model_copy(deep=True))
        return record

    def decisions(self, served_name: str | None = None) -> list[PolicyDecision]:
        with self._lock:
            found = [d for d in self._decisions if served_name is None or d.served_name == served_name]
        return [d.model_copy(deep=True) for d in found]

    def latest_decisions(self) -> dict[str, PolicyDecision]:
        with self._lock:
            latest = {d.served_name: d for d in self._decisions}
        return {name: d.model_copy(deep=True) for name, d in latest.items()}


class _QueueView:
    def __init__(self, entries: dict[str, QueueEntry]) -> None:
        self._entries = entries

    def select(self, *, status: Sequence[QueueStatus], group_ids: Sequence[str] | None = None,
               queue_id: str | None = None, limit: int | None = None) -> list[QueueEntry]:
        out = [e for e in self._entries.values()
               if e.status in status and (group_ids is None or e.group_id in group_ids)
               and (queue_id is None or e.queue_id == queue_id)]
        out.sort(key=lambda e: (e.created, e.attempt))
        return out[:limit] if limit is not None else out

    def put(self, entries: Iterable[QueueEntry]) -> None:
        for e in entries:
            self._entries[e.queue_id] = e

    # a scan: a store in memory serves one process, not a fleet (SQLite and PostgreSQL read an index)
    def expired(self, now: float) -> list[QueueEntry]:
        return [e for e in self._entries.values() if e.status == QueueStatus.LEASED
                and e.lease_expires is not None and e.lease_expires < now]

    def held(self, runner: str, key: str) -> list[QueueEntry]:
        return sorted((e for e in self._entries.values() if e.status == QueueStatus.LEASED and e.runner == runner
                       and e.lease_key == key), key=lambda e: (e.created, e.attempt))
