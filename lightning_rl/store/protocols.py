"""The store as a few small protocols. ``SQLiteStore``, ``InMemoryStore`` and ``HttpStore`` implement
every one explicitly (``tests/store/test_protocols.py`` checks it); code that needs only a part of a
store asks for that part.

* ``SpanSink``: what the tracer writes (``lightning_rl/sink.py``, at the bottom of the package with the
  records: the tracer and the store both import it, never each other).
* ``RolloutReader``: rollouts, their spans and rewards, one filtered page (the viewer's list).
* ``RolloutIndex``: the questions a store answers without reading every record (SQL where it has it,
  a scan in the memory store; ``store/scan.py``).
* ``RewardLog``: late rewards (user feedback) and the rewards a poller has not seen.
* ``TaskQueue``: tasks tried n times, leased to runners, cancelled by whoever queued them (the rules:
  ``store/task_queue.py``).
* ``PolicyLog``: which weights each served name answers with, and the decisions about them (the gate's,
  rollbacks).
* ``Store``: all of them, plus ingest, erasure, the quarantine and closing.

What is derived from these (trajectories, samples, id prefixes, the idle sweep, waiting for groups)
is a function over the protocol it needs, in ``store/queries.py``, written once for every store.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..records import (
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
)
from ..sink import SpanSink
from .ops import Op


@runtime_checkable
class RolloutReader(Protocol):
    """Stored rollouts with their spans and rewards. Unknown ids raise ``RolloutNotFoundError``."""

    url: str

    def get_rollout(self, rollout_id: str) -> Rollout: ...

    def rollouts(self, *, mode: str | None = None, status: str | RolloutStatus | None = None,
                 since: float | dt.datetime | None = None, min_policy_version: int | None = None,
                 limit: int | None = None, newest_first: bool = False) -> list[Rollout]:
        """Oldest first (or newest first), filtered on the rollouts' own fields."""
        ...

    def rollout_page(self, query: RolloutQuery | None = None, **filters: Any) -> RolloutPage:
        """One page of rollouts, filtered and sorted (``RolloutQuery``; keyword filters build one)."""
        ...

    def spans(self, rollout_id: str) -> list[Span]: ...

    def rewards(self, rollout_id: str) -> list[Reward]: ...

    def rollout_data(self, rollout_ids: Sequence[str]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        """Each rollout with its spans and rewards, in the order given, read as the caller iterates (a
        store over HTTP asks for them in batches)."""
        ...


@runtime_checkable
class RolloutIndex(Protocol):
    """Questions about many rollouts that a SQL store answers without reading their records."""

    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]: ...

    def rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        """Up to ``limit`` rollout ids starting with ``prefix``, in order."""
        ...

    def llm_call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """How many LLM calls each (existing) rollout recorded (a finished rollout with none trains nothing)."""
        ...

    def last_activity(self, rollout_id: str) -> float | None:
        """When its last span ended or its last reward came (UNIX time); None when neither happened."""
        ...


@runtime_checkable
class RewardLog(Protocol):
    def add_reward(self, rollout_id: str, value: float, name: str = "reward", *, llm_call_index: int | None = None,
                   agent: str | None = None, source: str | RewardSource = RewardSource.FEEDBACK,
                   uid: str | None = None) -> Reward:
        """Attach a reward to a rollout, also long after it ended (user feedback). Durable on return.
        Give ``uid`` to make a retried call idempotent (the same uid is stored once)."""
        ...

    def rewarded_since(self, after: int = 0, *, name: str | None = None,
                       limit: int = 10_000) -> tuple[list[str], int]:
        """Rollouts that got a reward (named ``name``, or any) since position ``after``, and the
        position to pass next time: a poller reads what is new, not the store's history."""
        ...


@runtime_checkable
class TaskQueue(Protocol):
    """Tasks tried n times (one group), leased to runners, retried when a runner dies (``task_queue.py``)."""

    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False,
                overrides: Mapping[str, Any] | None = None) -> list[QueueEntry]:
        """Queue ``task`` to be tried ``n`` times (one group). Returns the new entries. ``once=True`` (with
        ``group_id``): if that group exists already, its entries are returned and nothing is added.
        ``overrides``: what the runner runs each try with (``QueueEntry.overrides``: endpoint, sampling)."""
        ...

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None, wait: float = 0.0) -> list[QueueEntry]:
        """Lease up to ``limit`` entries to ``runner`` (expired leases are re-issued). Asking again with the
        same ``key`` returns what that request leased (a retry after a lost answer). ``wait``: a long poll,
        answering as soon as something can be leased, or empty after ``wait`` seconds."""
        ...

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0,
                  rollout_id: str | None = None) -> bool:
        """Extend ``runner``'s lease; False once it is lost. With ``rollout_id``, False once the entry is
        another try (its lease expired and it was leased again, even to this runner)."""
        ...

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str, *,
                 rollout_id: str | None = None) -> bool:
        """Record a try's outcome, after the records written so far (an outcome never overtakes the
        rollout it reports on). False if ``runner`` no longer holds the lease (it expired). With
        ``rollout_id`` (the runner always sends it) only that try's: False once the entry is another try."""
        ...

    def cancel(self, queue_ids: Sequence[str], *, reason: str = "") -> list[str]:
        """Cancel the tries ``queue_ids`` that are queued or leased: no runner leases them again, and the runner
        holding one is refused (``heartbeat`` and ``complete`` answer False); a leased try's rollout is
        ``timed_out`` whatever it reports, with ``reason`` in its error. Returns the ids among ``queue_ids`` that
        are cancelled (also those cancelled before: a retry gets the same answer); done and unknown ones are
        left out."""
        ...

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]: ...

    def expire_rollout(self, entry: QueueEntry, reason: str) -> None:
        """The queue gave up on this try (its lease expired, or its runner stopped waiting): its rollout
        is ``timed_out`` whatever it reports, now or later."""
        ...


@runtime_checkable
class PolicyLog(Protocol):
    def record_policy(self, served_name: str, version: int, *, adapter: str | None = None,
                      time: float | None = None, trained_on: Sequence[str] | None = None,
                      served_as: str | None = None) -> PolicyRecord:
        """Record a publish (trainers call it after the weights are live). Durable on return.
        ``trained_on``: the group ids of the rollouts whose samples made this version (its lineage);
        ``served_as``: the version's own name on every serving replica (``PolicyRecord.served_as``)."""
        ...

    def policies(self, served_name: str | None = None) -> list[PolicyRecord]:
        """Every recorded publish (of ``served_name``, or of all), oldest first."""
        ...

    def latest_policies(self) -> dict[str, PolicyRecord]:
        """The latest publish of each served name: what it answers with now."""
        ...

    def record_decision(self, served_name: str, version: int, decision: str, *, live_version: int | None = None,
                        adapter: str | None = None, figures: Mapping[str, Any] | None = None,
                        reason: str | None = None, time: float | None = None) -> PolicyDecision:
        """Record a decision about ``served_name``'s policy (``Decision``: evaluated, promoted, refused,
        rolled_back, canary) with its figures, next to the publishes. Durable on return."""
        ...

    def decisions(self, served_name: str | None = None) -> list[PolicyDecision]:
        """Every recorded decision (about ``served_name``, or all), oldest first."""
        ...

    def latest_decisions(self) -> dict[str, PolicyDecision]:
        """The latest decision about each served name (a ``canary`` one: a candidate takes a share of its
        production traffic now)."""
        ...


@runtime_checkable
class Store(SpanSink, RolloutReader, RolloutIndex, RewardLog, TaskQueue, PolicyLog, Protocol):
    """A whole store: every protocol above, plus ingest, erasure, the quarantine and closing."""

    def add_spans(self, spans: list[Span]) -> None:
        """Ingest spans recorded elsewhere (idempotent by ``(rollout_id, seq)``), after everything
        written before; kept on return."""
        ...

    def write_batch(self, ops: list[Op]) -> None:
        """Write ops idempotently, in order (the store server's write path); kept on return."""
        ...

    def delete_rollouts(self, rollout_ids: Iterable[str], *, full: bool = False) -> int:
        """Erase rollouts with everything that belongs to them (spans, rewards, queue entries, quarantined
        records, lines waiting in this process's spill files); others keep everything, policy records stay.
        Their text is gone from the store's files on return, as far as the database allows
        (``store/erasure.py``, ``docs/retention.md``); ``full`` also rebuilds the files (SQLite ``VACUUM``,
        PostgreSQL ``VACUUM FULL``). Returns how many rollouts were removed (unknown ids are ignored)."""
        ...

    def quarantined(self, *, limit: int = 1000) -> list[QuarantinedRecord]:
        """Records this store set aside because they could not be written, newest first, each with its
        reason and original form (``lightning-rl store doctor`` shows them)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> "Store": ...

    def __exit__(self, *exc: object) -> None: ...


__all__ = ["PolicyLog", "RewardLog", "RolloutIndex", "RolloutReader", "SpanSink", "Store", "TaskQueue"]
