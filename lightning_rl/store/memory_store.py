"""InMemoryStore: the same contract as SQLiteStore, kept in memory (tests, quick experiments).

Built on the store kit (``kit/base.py``): it implements the storage primitives over dicts under a lock;
writes are applied at once (what a SQLite store could not hold is quarantined here too: one contract);
index questions and the rollout page are the kit's scans (``store/scan.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..diagnostics import count
from ..records import PolicyDecision, PolicyRecord, QuarantinedRecord, QueueEntry, Reward, Rollout, Span
from .kit.backends import StoreBackend, register_store_backend
from .kit.base import KitStore
from .kit.batch import Batch, expired, finished
from .kit.in_process import DictQueueView
from .rows import span_from_values


class InMemoryStore(KitStore):
    """A store in this process's memory (every protocol of ``store/protocols.py``)."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self._lock = threading.Lock()
        self._rollouts: dict[str, Rollout] = {}
        self._spans: dict[str, dict[int, Span]] = {}
        self._rewards: dict[str, list[Reward]] = {}
        self._reward_uids: set[str] = set()
        self._reward_log: list[tuple[str | None, str | None]] = []  # (rollout_id, name) in arrival order
        self._logs: dict[type, list[Any]] = {PolicyRecord: [], PolicyDecision: []}
        self._queue: dict[str, QueueEntry] = {}
        self._qlock = threading.Lock()
        self._notes: list[QuarantinedRecord] = []

    def _write(self, batch: Batch) -> None:
        # spans: the same row round trip as the SQLite store (messages lifted, tokens packed)
        spans = [span_from_values(values) for values in batch.spans]
        rejected = 0
        with self._lock:
            for rollout in batch.rollouts:
                self._rollouts.setdefault(rollout.rollout_id, rollout.model_copy())
            for span in spans:
                self._spans.setdefault(span.rollout_id, {}).setdefault(span.seq, span)
            for reward in batch.rewards:
                if reward.uid not in self._reward_uids:
                    self._reward_uids.add(reward.uid)
                    self._reward_log.append((reward.rollout_id, reward.name))
                    self._rewards.setdefault(reward.rollout_id, []).append(reward)
            for op in batch.finishes:
                done = finished(self._rollouts.get(op.rollout_id), op)
                if done is None:
                    rejected += 1
                else:
                    self._rollouts[op.rollout_id] = done
            for tombstone in batch.expires:
                self._rollouts[tombstone.rollout_id] = expired(self._rollouts.get(tombstone.rollout_id), tombstone)
            for note in batch.notes:
                self._notes.append(QuarantinedRecord(
                    quarantine_id=len(self._notes) + 1, time=time.time(), kind=note.what, rollout_id=note.rollout_id,
                    reason=note.reason, payload=note.payload))
        if rejected:
            count("rejected_status_transitions", rejected)
        if batch.notes:
            count("records_quarantined", len(batch.notes))

    def _rollout(self, rollout_id: str) -> Rollout | None:
        with self._lock:
            return self._rollouts.get(rollout_id)

    def _all_rollouts(self) -> list[Rollout]:
        with self._lock:
            return list(self._rollouts.values())  # insertion order = start order

    def _spans_of(self, rollout_id: str) -> list[Span]:
        with self._lock:
            spans = self._spans.get(rollout_id, {})
            return [spans[k] for k in sorted(spans)]

    def _rewards_of(self, rollout_id: str) -> list[Reward]:
        with self._lock:
            return list(self._rewards.get(rollout_id, []))

    def _rewards_after(self, after: int) -> list[tuple[int, str, str]]:
        with self._lock:
            log = self._reward_log[after:]
        return [(after + i + 1, rid, name) for i, (rid, name) in enumerate(log) if rid is not None]

    def _queue_txn(self, fn: Callable[[DictQueueView], Any]) -> Any:
        with self._qlock:
            return fn(DictQueueView(self._queue))

    def _append(self, record: PolicyRecord | PolicyDecision) -> None:
        with self._lock:
            self._logs[type(record)].append(record)

    def _records(self, kind: type) -> list[Any]:
        with self._lock:
            return list(self._logs[kind])

    def _erase(self, rollout_ids: set[str]) -> int:
        with self._lock:
            removed = sum(self._rollouts.pop(rid, None) is not None for rid in rollout_ids)
            for rid in rollout_ids:
                self._spans.pop(rid, None)
                for reward in self._rewards.pop(rid, []):
                    self._reward_uids.discard(reward.uid)
            # positions stay where they were (a poller's next position is one of them); erased ones read as nothing
            self._reward_log = [(rid, name) if rid not in rollout_ids else (None, None)
                                for rid, name in self._reward_log]
            self._notes = [q for q in self._notes if q.rollout_id not in rollout_ids]
        with self._qlock:
            for queue_id in [q for q, e in self._queue.items() if e.rollout_id in rollout_ids]:
                del self._queue[queue_id]
        return removed

    def _quarantine(self, limit: int) -> list[QuarantinedRecord]:
        with self._lock:
            return list(reversed(self._notes))[:limit]


BACKEND = register_store_backend(StoreBackend(
    "memory", ("memory",), lambda where, *, read_only=False: InMemoryStore(), examples=("memory://",),
    locate=lambda url: "", same=None))  # each open is a new store
