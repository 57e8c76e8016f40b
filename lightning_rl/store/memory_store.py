"""InMemoryStore: the same contract as SQLiteStore, kept in memory (tests, quick experiments)."""

from __future__ import annotations

import threading
import time
from typing import Any

from ..diagnostics import count
from ..records import (PolicyRecord, QuarantinedRecord, QueueEntry, Reward, Rollout, RolloutStatus, Span, SpanRow,
                       allowed_from)
from .base import Store
from .quarantine import describe, record_problem
from .rows import legacy_span_values, span_from_values, span_record_values, span_values


class InMemoryStore(Store):
    def __init__(self) -> None:
        self.url = "memory://"
        self._lock = threading.Lock()
        self._rollouts: dict[str, Rollout] = {}
        self._spans: dict[str, dict[int, Span]] = {}
        self._rewards: dict[str, list[Reward]] = {}
        self._reward_uids: set[str] = set()
        self._reward_log: list[tuple[str, str]] = []  # (rollout_id, name) in arrival order
        self._policies: list[PolicyRecord] = []
        self._queue: dict[str, QueueEntry] = {}
        self._qlock = threading.Lock()
        self._quarantine: list[QuarantinedRecord] = []

    # sink
    def start_rollout(self, rollout: Rollout) -> None:
        with self._lock:
            self._rollouts.setdefault(rollout.rollout_id, rollout.model_copy())

    def write_span(self, row: SpanRow) -> None:
        problem = record_problem("span", row)
        if problem:  # what a SQLite store could not hold is set aside here too: one contract
            self._set_aside("span", row, ValueError(problem))
            return
        span = span_from_values(span_values(row))  # the same JSON round trip as the SQLite store
        with self._lock:
            self._spans.setdefault(span.rollout_id, {}).setdefault(span.seq, span)

    def _set_aside(self, kind: str, payload: Any, exc: BaseException) -> None:
        rollout_id, reason, text = describe(kind, payload, exc)
        with self._lock:
            self._quarantine.append(QuarantinedRecord(quarantine_id=len(self._quarantine) + 1, time=time.time(),
                                                      kind=kind, rollout_id=rollout_id, reason=reason, payload=text))
        count("records_quarantined")

    def _quarantined(self, limit: int) -> list[QuarantinedRecord]:
        with self._lock:
            return list(reversed(self._quarantine))[:limit]

    def write_reward(self, reward: Reward) -> None:
        with self._lock:
            if reward.uid in self._reward_uids:
                return
            self._reward_uids.add(reward.uid)
            self._reward_log.append((reward.rollout_id, reward.name))
            self._rewards.setdefault(reward.rollout_id, []).append(reward)

    def finish_rollout(self, rollout_id: str, status: RolloutStatus, end_time: float, error: str | None,
                       policy_version: int | None = None) -> None:
        with self._lock:
            rollout = self._rollouts.get(rollout_id)
            if rollout is None or rollout.status not in allowed_from(status):
                count("rejected_status_transitions")
                return
            self._rollouts[rollout_id] = rollout.model_copy(
                update={"status": RolloutStatus(status), "end_time": end_time, "error": error,
                        "policy_version": rollout.policy_version if policy_version is None else policy_version}
            )

    def expire_rollout(self, entry: QueueEntry, reason: str) -> None:
        tombstone = self._tombstone(entry, reason)
        with self._lock:
            rollout = self._rollouts.setdefault(entry.rollout_id, tombstone)
            if rollout.status != RolloutStatus.TIMED_OUT:
                self._rollouts[entry.rollout_id] = rollout.model_copy(update={
                    "status": RolloutStatus.TIMED_OUT, "end_time": tombstone.end_time, "error": reason})

    def write_batch(self, items) -> None:
        for kind, payload in items:
            if kind == "rollout":
                self.start_rollout(payload)
            elif kind == "span_values":
                problem = record_problem(kind, payload)
                if problem:
                    self._set_aside(kind, payload, ValueError(problem))
                    continue
                self._add_span(span_from_values(legacy_span_values(payload)))
            elif kind == "reward":
                self.write_reward(payload)
            elif kind == "finish":
                self.finish_rollout(*payload)

    def add_spans(self, spans: list[Span]) -> None:
        for span in spans:  # the same row round trip as the SQLite store (token attributes lifted and packed)
            self._add_span(span_from_values(span_record_values(span)))

    def _add_span(self, span: Span) -> None:
        with self._lock:
            self._spans.setdefault(span.rollout_id, {}).setdefault(span.seq, span)

    # primitives
    def _get_rollout(self, rollout_id: str) -> Rollout | None:
        with self._lock:
            return self._rollouts.get(rollout_id)

    def _query_rollouts(self, *, mode, status, since, min_policy_version, limit, newest_first) -> list[Rollout]:
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

    def _get_spans(self, rollout_id: str) -> list[Span]:
        with self._lock:
            return [self._spans.get(rollout_id, {})[k] for k in sorted(self._spans.get(rollout_id, {}))]

    def _get_rewards(self, rollout_id: str) -> list[Reward]:
        with self._lock:
            return list(self._rewards.get(rollout_id, []))

    def _insert_reward(self, reward: Reward) -> None:
        self.write_reward(reward)

    def _queue_txn(self, fn):
        with self._qlock:
            return fn(_MemoryQueueView(self._queue))

    def _insert_policy(self, record: PolicyRecord) -> None:
        record = record.model_copy(deep=True)  # its trained_on list: nobody's but the store's, as in a file
        with self._lock:
            self._policies.append(record)

    def _query_policies(self, served_name: str | None, latest: bool = False) -> list[PolicyRecord]:
        with self._lock:
            found = [p for p in self._policies if served_name is None or p.served_name == served_name]
        found = list({p.served_name: p for p in found}.values()) if latest else found
        return [p.model_copy(deep=True) for p in found]

    def _rewards_after(self, after: int, name: str | None, limit: int) -> list[tuple[int, str]]:
        with self._lock:
            log = self._reward_log[after:]
        out = [(after + i + 1, rid) for i, (rid, n) in enumerate(log) if name is None or n == name]
        return out[:limit]


class _MemoryQueueView:
    def __init__(self, entries: dict[str, QueueEntry]) -> None:
        self._entries = entries

    def select(self, *, status, group_ids=None, queue_id=None, limit=None):
        out = [e for e in self._entries.values()
               if e.status in status and (group_ids is None or e.group_id in group_ids)
               and (queue_id is None or e.queue_id == queue_id)]
        out.sort(key=lambda e: (e.created, e.attempt))
        return out[:limit] if limit is not None else out

    def put(self, entries) -> None:
        for e in entries:
            self._entries[e.queue_id] = e
