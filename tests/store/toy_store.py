"""A toy store backend added through the store kit, as docs/extending.md ("Add a store backend") says:
one class of the kit's storage primitives over plain dicts, and one registration of its URL scheme.
The contract suite runs on it through the ``store`` fixture's ``toy`` parameter (``tests/conftest.py``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from lightning_rl import diagnostics
from lightning_rl.records import QuarantinedRecord, Reward, Rollout, Span
from lightning_rl.store.kit import Batch, DictQueueView, KitStore, StoreBackend, expired, finished, \
    register_store_backend
from lightning_rl.store.kit.backends import STORE_BACKENDS
from lightning_rl.store.rows import span_from_values


class ToyStore(KitStore):
    """Every table a dict (or a list) in this process, one lock for all of them."""

    def __init__(self, name: str = "") -> None:
        super().__init__(f"toy://{name}")
        self.lock = threading.RLock()
        self.rollout_table: dict[str, Rollout] = {}
        self.span_table: dict[tuple[str, int], Span] = {}  # by (rollout_id, seq)
        self.reward_table: dict[str, Reward] = {}  # by uid, in arrival order
        self.reward_positions: list[str | None] = []  # the uid of each reward by position; None once erased
        self.queue: dict[str, Any] = {}
        self.logs: dict[type, list[Any]] = {}
        self.notes: list[QuarantinedRecord] = []

    # -- writes --------------------------------------------------------------------------------------------
    def _write(self, batch: Batch) -> None:
        with self.lock:
            for rollout in batch.rollouts:
                self.rollout_table.setdefault(rollout.rollout_id, rollout)
            for values in batch.spans:
                span = span_from_values(values)
                self.span_table.setdefault((span.rollout_id, span.seq), span)
            for reward in batch.rewards:
                if reward.uid not in self.reward_table:
                    self.reward_table[reward.uid] = reward
                    self.reward_positions.append(reward.uid)
            for op in batch.finishes:
                done = finished(self.rollout_table.get(op.rollout_id), op)
                if done is None:
                    diagnostics.count("rejected_status_transitions")
                else:
                    self.rollout_table[op.rollout_id] = done
            for tombstone in batch.expires:
                self.rollout_table[tombstone.rollout_id] = expired(self.rollout_table.get(tombstone.rollout_id), tombstone)
            for note in batch.notes:
                self.notes.append(QuarantinedRecord(quarantine_id=len(self.notes) + 1, time=time.time(),
                                                    kind=note.what, rollout_id=note.rollout_id, reason=note.reason,
                                                    payload=note.payload))
                diagnostics.count("records_quarantined")

    # -- reads -----------------------------------------------------------------------------------------------
    def _rollout(self, rollout_id: str) -> Rollout | None:
        with self.lock:
            return self.rollout_table.get(rollout_id)

    def _all_rollouts(self) -> list[Rollout]:
        with self.lock:
            return list(self.rollout_table.values())

    def _spans_of(self, rollout_id: str) -> list[Span]:
        with self.lock:
            return sorted((s for (rid, _), s in self.span_table.items() if rid == rollout_id), key=lambda s: s.seq)

    def _rewards_of(self, rollout_id: str) -> list[Reward]:
        with self.lock:
            return [r for r in self.reward_table.values() if r.rollout_id == rollout_id]

    def _rewards_after(self, after: int) -> list[tuple[int, str, str]]:
        with self.lock:
            return [(position, self.reward_table[uid].rollout_id, self.reward_table[uid].name)
                    for position, uid in enumerate(self.reward_positions[after:], start=after + 1) if uid is not None]

    # -- the queue, the logs, erasure, the quarantine --------------------------------------------------------
    def _queue_txn(self, fn: Any) -> Any:
        with self.lock:
            return fn(DictQueueView(self.queue))

    def _append(self, record: Any) -> None:
        with self.lock:
            self.logs.setdefault(type(record), []).append(record)

    def _records(self, kind: type) -> list[Any]:
        with self.lock:
            return list(self.logs.get(kind, []))

    def _erase(self, rollout_ids: set[str]) -> int:
        with self.lock:
            removed = sum(self.rollout_table.pop(rid, None) is not None for rid in rollout_ids)
            self.span_table = {key: s for key, s in self.span_table.items() if key[0] not in rollout_ids}
            gone = {uid for uid, r in self.reward_table.items() if r.rollout_id in rollout_ids}
            self.reward_table = {uid: r for uid, r in self.reward_table.items() if uid not in gone}
            self.reward_positions = [None if uid in gone else uid for uid in self.reward_positions]
            self.queue = {q: e for q, e in self.queue.items() if e.rollout_id not in rollout_ids}
            self.notes = [n for n in self.notes if n.rollout_id not in rollout_ids]
        return removed

    def _quarantine(self, limit: int) -> list[QuarantinedRecord]:
        with self.lock:
            return self.notes[::-1][:limit]


if "toy" not in STORE_BACKENDS:  # one registration per process, however often the module is imported
    register_store_backend(StoreBackend("toy", ("toy",), lambda where, read_only=False: ToyStore(where),
                                        examples=("toy://NAME",), locate=lambda url: url.split("://", 1)[1],
                                        same=None))
