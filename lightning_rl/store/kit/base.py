"""``KitStore``: what every store does the same way, written once over a backend's storage primitives.

**Written here, once.** The sink funnel (``start_rollout``, ``write_span``, ``write_reward``,
``finish_rollout``, ``flush``) and ingest (``add_spans``, ``write_batch``, ``add_reward``) hand the writer's
ops (``store/ops.py``) to ``self._writer``; ``sort_ops`` (``kit/batch.py``) is the one dispatch of those ops
into a :class:`Batch` (rows by table, in the order a batch is written); the task queue's rules
(``task_queue.py``) run over ``_queue_txn``; and every query has a default that scans the primitives
below. A SQL backend overrides the queries it answers from an index (``kit/rollout_sql.py`` builds its
rollout page); the rules stay here.

**What a backend implements (11 storage primitives):**

====================================  ==================================================================
``_write(batch)``                     write one :class:`Batch`: starts (kept once per id), spans (once per
                                      ``(rollout_id, seq)``), rewards (once per uid), finishes
                                      (``finished``), expiries (``expired``), quarantine notes
``_rollout(rollout_id)``              the rollout, or None
``_all_rollouts()``                   every rollout, in the order they started
``_spans_of(rollout_id)``             its spans by ``seq``
``_rewards_of(rollout_id)``           its rewards in arrival order
``_rewards_after(after)``             ``(position, rollout_id, name)`` of each reward after ``after``
``_queue_txn(fn)``                    ``fn(view)`` atomically (``task_queue.QueueView``)
``_append(record)``                   keep a ``PolicyRecord`` or ``PolicyDecision``
``_records(kind)``                    every kept record of that type, oldest first
``_erase(rollout_ids)``               remove them with everything that belongs to them; how many were there
``_quarantine(limit)``                the quarantined records, newest first
====================================  ==================================================================

plus ``url``, and ``__init__`` calling ``KitStore.__init__`` (a store that writes at once gets the
:class:`ImmediateWriter`; one with a background writer sets ``self._writer``: ``None`` when read-only).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ...errors import StoreError
from ...records import (
    PolicyDecision,
    PolicyRecord,
    QuarantinedRecord,
    QueueEntry,
    Reward,
    RewardSource,
    Rollout,
    RolloutPage,
    RolloutQuery,
    RolloutStatus,
    Span,
    SpanRow,
)
from ...settings import Settings
from .. import checks, scan, task_queue
from ..durable import INGEST_CHUNK
from ..ops import EncodedSpan, ExpireTry, FinishRollout, Op, StartRollout, TracedSpan, WriteReward
from ..rows import span_record_values
from .batch import Batch, expired, finished, sort_ops
from .in_process import DictQueueView, ImmediateWriter

#: ``Batch``, ``sort_ops``, ``finished``, ``expired`` (``kit/batch.py``), ``ImmediateWriter`` and ``DictQueueView``
#: (``kit/in_process.py``) are imported from here too.
__all__ = ["Batch", "DictQueueView", "ImmediateWriter", "KitStore", "expired", "finished", "sort_ops"]


class KitStore:
    """The shared part of every store (module doc). Subclasses implement the storage primitives."""

    url: str
    read_only: bool = False
    _closed: bool = False
    _writer: Any = None
    #: The writes that return once they are in the database itself, not in a spill file (``add_spans``,
    #: ``write_batch``, ``add_reward``); the others return once they are kept (written or spilled).
    _confirmed_in_database: frozenset[str] = frozenset({"add_spans", "write_batch", "add_reward"})

    def __init__(self, url: str, *, read_only: bool = False) -> None:
        self.url = url
        self.read_only = read_only
        self._closed = False
        self._bell = task_queue.Bell()  # rung by this process's enqueues: its waiting leases wake at once
        self._writer = ImmediateWriter(self._write)

    @property
    def _where(self) -> str:
        """The store as messages name it."""
        return self.url

    def _put(self, op: Op, what: str) -> None:
        writer = self._writer
        if writer is None:
            raise checks.read_only(what, self._where)
        writer.put(op)

    def _kept(self, what: str, timeout: float | None = None) -> bool:
        """Wait until what was written so far is kept (written, or in a spill file where ``what`` allows it)."""
        if timeout is None:
            timeout = Settings.from_env().flush_timeout
        if what in self._confirmed_in_database:
            return self._writer.flush_applied(timeout)
        return self._writer.flush(timeout)

    # -- SpanSink (the tracer's; never blocks except for back-pressure) --------------------------------
    def start_rollout(self, rollout: Rollout) -> None:
        self._put(StartRollout(rollout), "start_rollout")

    def write_span(self, row: SpanRow) -> None:
        self._put(TracedSpan(row), "write_span")

    def write_reward(self, reward: Reward) -> None:
        self._put(WriteReward(reward), "write_reward")

    def finish_rollout(self, rollout_id: str, status: RolloutStatus, end_time: float, error: str | None,
                       policy_version: int | None = None) -> None:
        self._put(FinishRollout(rollout_id, RolloutStatus(status), end_time, error, policy_version), "finish_rollout")

    def flush(self, timeout: float | None = None) -> bool:
        if self._closed or self._writer is None:
            return True
        return self._writer.flush(timeout)

    @property
    def pending_writes(self) -> int:
        return 0 if self._writer is None else self._writer.pending

    # -- ingest ----------------------------------------------------------------------------------------
    def write_batch(self, ops: list[Op]) -> None:
        """Ops after everything written before, idempotently (the store server's write path); kept on return.
        Ops a database store could only spill are not acknowledged: StoreError, and the client retries."""
        if self._writer is None:
            raise checks.read_only("write_batch", self._where)
        self._writer.put_many(ops)
        if not self._kept("write_batch"):
            raise StoreError(f"{len(ops)} records are not in {self._where} yet (it could not be written in time; "
                             "they are kept in its spill file and written back when it can be)")

    def add_spans(self, spans: list[Span]) -> None:
        """Ingest spans recorded elsewhere (batched, idempotent by (rollout_id, seq)); kept on return."""
        if self._writer is None:
            raise checks.read_only("add_spans", self._where)
        for start in range(0, len(spans), INGEST_CHUNK):  # whole batches for the writer, back-pressure between
            self._writer.put_many([EncodedSpan(span_record_values(s)) for s in spans[start:start + INGEST_CHUNK]])
        if not self._kept("add_spans"):
            raise StoreError(f"{len(spans)} spans are not in {self._where} yet (kept in its spill file, written back "
                             "when it can be)")

    def add_reward(self, rollout_id: str, value: float, name: str = "reward", *, llm_call_index: int | None = None,
                   agent: str | None = None, source: str | RewardSource = RewardSource.FEEDBACK,
                   uid: str | None = None) -> Reward:
        if self._writer is None:
            raise checks.read_only("add_reward", self._where)
        reward = checks.new_reward(rollout_id, value, name, llm_call_index=llm_call_index, agent=agent, source=source,
                                   uid=uid)
        self.flush()  # a rollout that just finished in this process must be visible
        self.get_rollout(rollout_id)
        self._writer.put(WriteReward(reward))
        if not self._kept("add_reward"):
            raise StoreError(f"the reward for {rollout_id!r} is not in {self._where} yet (kept in its spill file)")
        return reward

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True

    # -- TaskQueue over ``_queue_txn`` (the rules: ``task_queue.py``) -----------------------------------
    _queue_ready: Callable[[], bool] | None = None  # a cheap read: can anything be leased (another process's)?

    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False,
                overrides: Mapping[str, Any] | None = None) -> list[QueueEntry]:
        if self.read_only:
            raise checks.read_only("enqueue", self._where)
        entries = task_queue.enqueue_in(self._queue_txn, task, n=n, mode=mode, max_tries=max_tries, group_id=group_id,
                                        once=once, overrides=overrides)
        self._bell.ring()  # this process's waiting leases, at once
        return entries

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None, wait: float = 0.0) -> list[QueueEntry]:
        """As every store's, on this process's clock; ``wait``: woken at once by an enqueue in this process
        (and, where the store has ``_queue_ready``, within 50 ms by one in another)."""
        def lease_now() -> list[QueueEntry]:
            return task_queue.lease_in(self._queue_txn, runner, lease_seconds=lease_seconds, limit=limit, key=key,
                                       expire_rollout=self.expire_rollout, flush=self.flush)

        if not wait:
            return lease_now()
        return task_queue.lease_waiting(lease_now, wait, self._bell, probe=self._queue_ready)

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0,
                  rollout_id: str | None = None) -> bool:
        return task_queue.heartbeat_in(self._queue_txn, queue_id, runner, lease_seconds, rollout_id)

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str, *,
                 rollout_id: str | None = None) -> bool:
        self.flush()  # the records written so far go first
        return task_queue.complete_in(self._queue_txn, queue_id, runner, outcome, rollout_id)

    def cancel(self, queue_ids: Sequence[str], *, reason: str = "") -> list[str]:
        """As every store's; a leased try's rollout is marked (``expire_rollout``) and flushed before the answer."""
        if self.read_only:
            raise checks.read_only("cancel", self._where)
        cancelled = task_queue.cancel_in(self._queue_txn, queue_ids, reason,
                                         lambda view, entry, why: self.expire_rollout(entry, why))
        self.flush()
        return cancelled

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        return task_queue.entries_in(self._queue_txn, group_ids)

    def expire_rollout(self, entry: QueueEntry, reason: str) -> None:
        self._put(ExpireTry(task_queue.tombstone(entry, reason)), "expire_rollout")

    # -- queries: scans over the primitives (a SQL backend overrides them) -------------------------------
    def get_rollout(self, rollout_id: str) -> Rollout:
        rollout = self._rollout(rollout_id)
        if rollout is None:
            raise checks.not_found(rollout_id, self.url)
        return rollout

    def rollouts(self, *, mode: str | None = None, status: str | RolloutStatus | None = None,
                 since: float | dt.datetime | None = None, min_policy_version: int | None = None,
                 limit: int | None = None, newest_first: bool = False) -> list[Rollout]:
        mode, status, since = checks.rollout_filters(mode, status, since, min_policy_version, limit)
        out = [r for r in self._all_rollouts()
               if (mode is None or r.mode == mode) and (status is None or r.status == status)
               and (since is None or r.start_time >= since)
               and (min_policy_version is None or (r.policy_version is not None
                                                   and r.policy_version >= min_policy_version))]
        out.sort(key=lambda r: r.start_time, reverse=newest_first)
        return out[:limit] if limit is not None else out

    def rollout_page(self, query: RolloutQuery | None = None, **filters: Any) -> RolloutPage:
        query = checks.rollout_query(query, filters)
        data = [(r, self._rewards_of(r.rollout_id)) for r in self._all_rollouts()]
        data.sort(key=lambda item: item[0].start_time)
        return scan.rollout_page(data, query)

    def spans(self, rollout_id: str) -> list[Span]:
        self.get_rollout(rollout_id)
        return self._spans_of(rollout_id)

    def rewards(self, rollout_id: str) -> list[Reward]:
        self.get_rollout(rollout_id)
        return self._rewards_of(rollout_id)

    def rollout_data(self, rollout_ids: Sequence[str]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        for rollout_id in rollout_ids:  # one at a time: a long rollout's tokens are large once unpacked
            rollout = self.get_rollout(rollout_id)
            yield rollout, self._spans_of(rollout_id), self._rewards_of(rollout_id)

    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]:
        return {rid for rid in rollout_ids if self._rollout(rid) is not None}

    def rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        return scan.ids_with_prefix([r.rollout_id for r in self._all_rollouts()], prefix, limit)

    def llm_call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        return scan.llm_call_counts(self, rollout_ids)

    def last_activity(self, rollout_id: str) -> float | None:
        return scan.last_activity(self._spans_of(rollout_id), self._rewards_of(rollout_id))

    def rewarded_since(self, after: int = 0, *, name: str | None = None, limit: int = 10_000) -> tuple[list[str], int]:
        checks.check_position(after)
        checks.check_count(limit, "limit")
        rows = [(position, rid) for position, rid, n in self._rewards_after(after)
                if name is None or n == name][:limit]
        return list(dict.fromkeys(rid for _, rid in rows)), (rows[-1][0] if rows else after)

    def record_policy(self, served_name: str, version: int, *, adapter: str | None = None,
                      time: float | None = None, trained_on: Sequence[str] | None = None,
                      served_as: str | None = None) -> PolicyRecord:
        record = checks.policy_record(served_name, version, adapter=adapter, time=time, trained_on=trained_on,
                                      served_as=served_as)
        self._append(record.model_copy(deep=True))  # a copy: its trained_on list is the store's alone
        return record

    def policies(self, served_name: str | None = None) -> list[PolicyRecord]:
        return [p.model_copy(deep=True) for p in self._records(PolicyRecord)
                if served_name is None or p.served_name == served_name]

    def latest_policies(self) -> dict[str, PolicyRecord]:
        return {p.served_name: p for p in self.policies()}

    def record_decision(self, served_name: str, version: int, decision: str, *, live_version: int | None = None,
                        adapter: str | None = None, figures: Mapping[str, Any] | None = None,
                        reason: str | None = None, time: float | None = None) -> PolicyDecision:
        record = checks.decision_record(served_name, version, decision, live_version=live_version, adapter=adapter,
                                        figures=figures, reason=reason, time=time)
        self._append(record.model_copy(deep=True))
        return record

    def decisions(self, served_name: str | None = None) -> list[PolicyDecision]:
        return [d.model_copy(deep=True) for d in self._records(PolicyDecision)
                if served_name is None or d.served_name == served_name]

    def latest_decisions(self) -> dict[str, PolicyDecision]:
        return {d.served_name: d for d in self.decisions()}

    def delete_rollouts(self, rollout_ids: Iterable[str], *, full: bool = False) -> int:
        from ..erasure import erased, rollout_id_list

        if self.read_only:
            raise checks.read_only("delete_rollouts", self._where)
        ids = rollout_id_list(rollout_ids)
        return erased(self._erase(set(ids))) if ids else 0

    def quarantined(self, *, limit: int = 1000) -> list[QuarantinedRecord]:
        checks.check_count(limit, "limit")
        return self._quarantine(limit)

    # -- the storage primitives (module doc) --------------------------------------------------------
    def _write(self, batch: Batch) -> None:
        raise NotImplementedError

    def _rollout(self, rollout_id: str) -> Rollout | None:
        raise NotImplementedError

    def _all_rollouts(self) -> list[Rollout]:
        raise NotImplementedError

    def _spans_of(self, rollout_id: str) -> list[Span]:
        raise NotImplementedError

    def _rewards_of(self, rollout_id: str) -> list[Reward]:
        raise NotImplementedError

    def _rewards_after(self, after: int) -> list[tuple[int, str, str]]:
        raise NotImplementedError

    def _queue_txn(self, fn: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def _append(self, record: PolicyRecord | PolicyDecision) -> None:
        raise NotImplementedError

    def _records(self, kind: type) -> list[Any]:
        raise NotImplementedError

    def _erase(self, rollout_ids: set[str]) -> int:
        raise NotImplementedError

    def _quarantine(self, limit: int) -> list[QuarantinedRecord]:
        raise NotImplementedError
