"""SQLiteStore: the durable default. WAL mode, recorded migrations, one background writer per process.

* Spans, rollouts and rewards are queued to a background writer as ops (``store/ops.py``; bounded
  queue: a full queue blocks the producer, nothing is dropped) and written in batched transactions
  (``sqlite/writes.py``). Reads are SQL on a second connection (``sqlite/reads.py``).
* A finishing rollout flushes, so it is on disk before the traced call returns.
* Several processes may write one file: WAL, ``BEGIN IMMEDIATE`` and a busy timeout; a retried
  batch cannot duplicate spans (unique ``(rollout_id, seq)``).
* A batch that cannot be written for ``give_up_after`` seconds (the file is locked, full, away) is
  spilled to ``<db>.spill/*.jsonl`` (one op per line, as the store server's wire encodes it), and so
  is everything after it, in order, until the writer has
  replayed the backlog (it tries every second while the store is open). A store opened later adopts
  the spill files of processes that are gone.
* A record that cannot be written for a reason in its own data (a value SQLite cannot bind, a spill
  line this version cannot read) goes to the ``quarantine`` table with the reason and its original form;
  the rest of its batch is written (``quarantine.py``). Nothing is retried that can never succeed.
* ``read_only=True`` (the viewer): no writer, no migration, no spill adoption or replay; the
  connections are ``query_only``.
* Files that are not lightning-rl stores, or come from a newer schema, are refused untouched.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...diagnostics import count, report_failure
from ...errors import ConfigurationError, StoreClosedError, StoreError
from ...records import (
    PolicyDecision,
    PolicyRecord,
    QuarantinedRecord,
    Reward,
    Rollout,
    RolloutPage,
    RolloutQuery,
    RolloutStatus,
    Span,
)
from ...settings import Settings, check_synchronous
from .. import checks, task_queue
from . import reads as sql
from .connections import NETWORK_FILESYSTEMS, connect, filesystem_type
from ..durable import DurableWrites
from ..kit.base import KitStore
from ..erasure import erased, rollout_id_list
from .erasure import erase_sqlite
from ..lifecycle import track
from .migrations import latest_version, migrate
from ..ops import Op, Quarantine
from .quarantine import insert_quarantine, is_record_error, read_quarantine
from ..spill import SpillFiles, forget_claims, spill_files_in
from .writes import QueueView, apply_ops, insert_decision, insert_policy, queue_ready
from ..tokens import PrefixSharer


class SQLiteStore(KitStore):
    """A store in one SQLite file (every protocol of ``store/protocols.py``; the sink funnel, ingest and the
    task queue's rules are the kit's, ``kit/base.py``)."""

    _confirmed_in_database = frozenset({"write_batch"})  # add_spans, add_reward: kept once written or spilled

    def __init__(
        self, path: str | os.PathLike[str], *, queue_size: int | None = None,
        give_up_after: float = 30.0, busy_timeout: float = 30.0, synchronous: str | None = None,
        read_only: bool = False,
    ) -> None:
        path = os.fspath(path)
        if path in ("", ":memory:"):
            raise ConfigurationError(
                f"SQLiteStore needs a file path, got {path!r}; use InMemoryStore (memory://) for a store in memory"
            )
        self.read_only = read_only
        if not read_only:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.url = f"sqlite:///{path}"
        settings = Settings.from_env()
        self._queue_size = queue_size or settings.queue_size
        self._give_up_after = give_up_after
        self._busy_timeout = busy_timeout
        self.synchronous = check_synchronous(synchronous or settings.sqlite_synchronous)
        self._closed = False
        self._bell = task_queue.Bell()  # rung by this process's enqueues: its waiting leases wake at once
        kind = filesystem_type(Path(path).parent)
        if kind in NETWORK_FILESYSTEMS:
            count("sqlite_on_network_filesystem")
            report_failure(f"sqlite on {kind}", message=(
                f"lightning-rl: the store {path!r} is on a network filesystem ({kind}). SQLite's locks and WAL "
                "do not hold across machines there, and writers on several machines can corrupt the file. Run "
                "`lightning-rl store serve --db PATH` on one machine and point every process at it with "
                "LIGHTNING_RL_STORE=http://HOST:PORT"))
        self._open()
        track(self)

    def _open(self) -> None:
        if self.read_only:
            self._open_read_only()
            return
        self._wconn = connect(self.path, self._busy_timeout, self.synchronous)
        try:
            #: The schema the file had when this store opened it (0: a new file); ``store migrate`` says it.
            self.schema_found = self._wconn.execute("PRAGMA user_version").fetchone()[0]
            migrate(self._wconn, self.path)
        except BaseException:
            self._wconn.close()
            raise
        self._rconn = connect(self.path, self._busy_timeout, self.synchronous)
        self._rlock = threading.Lock()
        self._qconn = connect(self.path, self._busy_timeout, self.synchronous)
        self._qlock = threading.Lock()
        self._durable = DurableWrites(
            where=repr(self.path), doctor=f"lightning-rl store doctor --store {self.path}",
            folder=Path(self.path + ".spill"), apply=self._apply, keep_aside=self._keep_aside,
            is_record_error=is_record_error, queue_size=self._queue_size, give_up_after=self._give_up_after,
            name=f"lightning-rl-writer:{Path(self.path).name}",
            # a running rollout's spans written on the agent's thread when their window closes (writer.py,
            # "Writing here"), except where every commit waits for the disk (synchronous=full)
            apply_here=None if self.synchronous == "full" else self._apply_here)
        self._writer, self._spills = self._durable.writer, self._durable.spills

    def _open_read_only(self) -> None:
        conn = connect(self.path, self._busy_timeout, read_only=True)
        version, latest = conn.execute("PRAGMA user_version").fetchone()[0], latest_version()
        if version != latest:
            conn.close()
            if version > latest:
                migrate(conn, self.path)  # raises SchemaTooNewError, naming the upgrade  # pragma: no cover
            raise StoreError(
                f"{self.path!r} has store schema {version}, older than this lightning-rl's ({latest}); a read-only "
                f"open does not migrate it. Run `lightning-rl store migrate --store {self.path}` once (it upgrades "
                "the file in place), then open it again")
        self._rconn, self._rlock = conn, threading.Lock()
        self._wconn = self._qconn = None
        self._qlock = threading.Lock()
        self._durable = self._writer = None
        self._spills = SpillFiles(Path(self.path + ".spill"))  # never adopted, never replayed: only listed

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise checks.read_only(what, repr(self.path))

    @property
    def _where(self) -> str:
        return repr(self.path)

    @property
    def spill_files(self) -> list[Path]:
        """Spill files waiting to be written back (read-only: every one in the folder, whoever owns it)."""
        if self.read_only:
            folder = self._spills.folder
            return spill_files_in(folder)
        return list(self._spills.files)

    def delete_rollouts(self, rollout_ids: Iterable[str], *, full: bool = False) -> int:
        """Erase rollouts (``store/erasure.py``): deleted with ``secure_delete`` (freed bytes zeroed), then the
        WAL emptied (``wal_checkpoint(TRUNCATE)``) before it returns; ``full`` also runs ``VACUUM``."""
        ids = rollout_id_list(rollout_ids)
        self._writable("delete_rollouts")
        if not ids:
            return 0

        def delete() -> int:
            with self._qlock:
                try:
                    return erase_sqlite(self._qconn, ids, full=full, busy_timeout=self._busy_timeout,
                                        where=repr(self.path))
                except sqlite3.OperationalError as exc:  # locked, full, away: nothing was deleted
                    raise StoreError(f"could not erase {len(ids)} rollout(s) from {self.path!r} ({exc}); their lines "
                                     "left the spill files, their rows are still there: run it again when the "
                                     "file can be written") from None

        return erased(self._durable.erase(ids, delete))

    def quarantined(self, *, limit: int = 1000) -> list[QuarantinedRecord]:
        checks.check_count(limit, "limit")
        with self._rlock:
            return read_quarantine(self._rconn, limit)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._durable.close()  # what is queued, and one last try of the backlog (what stays is adopted later)
            self._wconn.close()
        # Each shared connection is closed under its lock, never under a query another thread runs on it (that
        # crashed the process: the tracer's policy refresh reads from its own thread), and is replaced by one
        # that says the store is closed.
        closed = _ClosedConnection(self.path)
        with self._rlock:
            self._rconn.close()
            self._rconn = closed
        with self._qlock:
            if self._qconn is not None:
                self._qconn.close()
                self._qconn = closed

    def _after_fork(self) -> None:
        """In a forked child: fresh connections and writer; the parent writes what it had queued."""
        self._closed = False
        forget_claims()
        self._open()

    # -- the writer thread ------------------------------------------------------------------------
    def _apply(self, ops: list[Op], sharer: PrefixSharer) -> list[str]:
        return apply_ops(self._wconn, ops, sharer)

    def _apply_here(self, ops: list[Op], sharer: PrefixSharer) -> list[str]:
        """``_apply`` on a putting thread: the database's lock is not waited for (``database is locked`` at once,
        and the writer writes the batch, waiting as long as it may)."""
        conn = self._wconn
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            return apply_ops(conn, ops, sharer)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")

    def _keep_aside(self, note: Quarantine) -> bool:
        """One record set aside (``durable.py``), in its own transaction."""
        conn = self._wconn
        conn.execute("BEGIN IMMEDIATE")
        try:
            added = insert_quarantine(conn, str(note.what), note.rollout_id, str(note.reason), str(note.payload))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return added

    # -- RolloutReader ------------------------------------------------------------------------------
    def _read(self, statement: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._rlock:
            return self._rconn.execute(statement, params).fetchall()

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._rlock:
            rollout = sql.get_rollout(self._rconn, rollout_id)
        if rollout is None:
            raise checks.not_found(rollout_id, self.url)
        return rollout

    def rollouts(self, *, mode: str | None = None, status: str | RolloutStatus | None = None,
                 since: float | dt.datetime | None = None, min_policy_version: int | None = None,
                 limit: int | None = None, newest_first: bool = False) -> list[Rollout]:
        mode, status, since = checks.rollout_filters(mode, status, since, min_policy_version, limit)
        with self._rlock:
            return sql.query_rollouts(self._rconn, mode=mode, status=status, since=since,
                                      min_policy_version=min_policy_version, limit=limit, newest_first=newest_first)

    def rollout_page(self, query: RolloutQuery | None = None, **filters: Any) -> RolloutPage:
        query = checks.rollout_query(query, filters)
        with self._rlock:
            return sql.rollout_page(self._rconn, query)

    def spans(self, rollout_id: str) -> list[Span]:
        self.get_rollout(rollout_id)
        with self._rlock:
            return sql.spans_of(self._rconn, rollout_id)

    def rewards(self, rollout_id: str) -> list[Reward]:
        self.get_rollout(rollout_id)
        with self._rlock:
            return sql.rewards_of(self._rconn, rollout_id)

    def rollout_data(self, rollout_ids: Sequence[str]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        for rollout_id in rollout_ids:  # one at a time: a long rollout's tokens are large once unpacked
            rollout = self.get_rollout(rollout_id)
            with self._rlock:
                spans, rewards = sql.spans_of(self._rconn, rollout_id), sql.rewards_of(self._rconn, rollout_id)
            yield rollout, spans, rewards

    # -- RolloutIndex -------------------------------------------------------------------------------
    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]:
        with self._rlock:
            return sql.existing_ids(self._rconn, rollout_ids)

    def rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        with self._rlock:
            return sql.ids_with_prefix(self._rconn, prefix, limit)

    def llm_call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        with self._rlock:
            return sql.llm_call_counts(self._rconn, rollout_ids)

    def last_activity(self, rollout_id: str) -> float | None:
        with self._rlock:
            return sql.last_activity(self._rconn, rollout_id)

    # -- RewardLog ----------------------------------------------------------------------------------
    def rewarded_since(self, after: int = 0, *, name: str | None = None, limit: int = 10_000) -> tuple[list[str], int]:
        checks.check_position(after)
        checks.check_count(limit, "limit")
        with self._rlock:
            rows = sql.rewards_after(self._rconn, after, name, limit)
        return list(dict.fromkeys(rid for _, rid in rows)), (rows[-1][0] if rows else after)

    # -- TaskQueue (synchronous, atomic across processes) --------------------------------------------
    def _queue_txn(self, fn):
        if self.read_only:  # reads of the queue only; a write is refused by query_only, said as read-only
            with self._rlock:
                conn = self._rconn
                conn.execute("BEGIN")
                try:
                    return fn(QueueView(conn))
                except sqlite3.OperationalError as exc:
                    self._writable(f"the task queue ({exc})")
                    raise
                finally:
                    conn.execute("ROLLBACK")
        with self._qlock:
            conn = self._qconn
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(QueueView(conn))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return result

    def _queue_ready(self) -> bool:
        with self._rlock:
            return queue_ready(self._rconn, time.time())

    # -- PolicyLog ----------------------------------------------------------------------------------
    def record_policy(self, served_name: str, version: int, *, adapter: str | None = None,
                      time: float | None = None, trained_on: Sequence[str] | None = None,
                      served_as: str | None = None) -> PolicyRecord:
        record = checks.policy_record(served_name, version, adapter=adapter, time=time, trained_on=trained_on,
                                      served_as=served_as)
        self._queue_txn(lambda view: insert_policy(view.conn, record))  # durable on return, as the queue
        return record

    def policies(self, served_name: str | None = None) -> list[PolicyRecord]:
        with self._rlock:
            return sql.query_policies(self._rconn, served_name)

    def latest_policies(self) -> dict[str, PolicyRecord]:
        with self._rlock:
            return {p.served_name: p for p in sql.query_policies(self._rconn, None, latest=True)}

    def record_decision(self, served_name: str, version: int, decision: str, *, live_version: int | None = None,
                        adapter: str | None = None, figures: Mapping[str, Any] | None = None,
                        reason: str | None = None, time: float | None = None) -> PolicyDecision:
        record = checks.decision_record(served_name, version, decision, live_version=live_version, adapter=adapter,
                                        figures=figures, reason=reason, time=time)
        self._queue_txn(lambda view: insert_decision(view.conn, record))  # durable on return, as a publish
        return record

    def decisions(self, served_name: str | None = None) -> list[PolicyDecision]:
        with self._rlock:
            return sql.query_decisions(self._rconn, served_name)

    def latest_decisions(self) -> dict[str, PolicyDecision]:
        with self._rlock:
            return {d.served_name: d for d in sql.query_decisions(self._rconn, None, latest=True)}


class _ClosedConnection:
    """Where a closed store's connections were: any use raises ``StoreClosedError``."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> Any:
        raise StoreClosedError(f"the SQLite store {self._path!r} is closed; open it again (open_store) to read or "
                               "write it")
