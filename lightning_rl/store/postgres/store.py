"""PostgresStore: the store in a PostgreSQL database, for fleets (every protocol of ``store/protocols.py``).

``postgresql://user@host:5432/db`` (``?schema=NAME``: the PostgreSQL schema its tables live in, default
``lightning_rl``) wherever a store URL is taken. The same records, queue, rewards, policies and quarantine as
the SQLite store, in the same rows (``postgres/schema.py``, ``postgres/sql.py``):

* Writes go through the same background writer (``durable.py``): a bounded queue (a full queue blocks the
  producer, nothing is dropped), batched transactions on a connection of its own, idempotent inserts. While
  the database cannot be reached (a restart, a failover), a batch is retried for ``give_up_after`` seconds,
  then spilled to a local file (``LIGHTNING_RL_SPILL_DIR``, default ``~/.cache/lightning-rl/spill/pg_HOST_PORT_DB``)
  with everything after it, in order, and replayed when the database answers.
* Reads and the task queue use a connection pool (psycopg 3). They are retried for ``retry_for`` seconds
  while the database cannot be reached (a runner waits out a restart), then raise :class:`StoreError`;
  every retried call is idempotent (a lease carries a key, an enqueue a group id).
* Any number of processes, on any machines, may open one database: leasing is atomic in the database, so
  ``lightning-rl store serve --db postgresql://...`` servers are stateless and many.
* ``read_only=True`` (the viewer): no writer, no migration, read-only transactions.

A password in the URL works (libpq also reads ``PGPASSWORD`` and ``~/.pgpass``); messages never show it.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ...errors import ConfigurationError, StoreError
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
from ...settings import Settings
from .. import checks, task_queue
from . import queue as pgq
from . import sql
from .connection import DEFAULT_SCHEMA, SCHEMES, _psycopg, _spill_folder, is_record_error, parse_url
from ..durable import DurableWrites
from ..erasure import erased, rollout_id_list
from .erasure import delete_postgres, vacuum_postgres
from ..spill import spill_files_in
from ..kit.base import KitStore
from ..lifecycle import track
from ..ops import Op, Quarantine
from .queue_methods import PostgresQueue
from .schema import check_version, latest_version, migrate

#: ``DEFAULT_SCHEMA``, ``SCHEMES``, ``parse_url`` and ``is_record_error`` (``connection.py``) are imported from
#: here too.
__all__ = ["DEFAULT_SCHEMA", "PostgresStore", "SCHEMES", "is_record_error", "parse_url"]

T = TypeVar("T")


class PostgresStore(PostgresQueue, KitStore):
    """A store in a PostgreSQL database (module doc; the sink funnel and ingest are the kit's, ``kit/base.py``;
    the task queue is ``queue_methods.py``'s)."""

    def __init__(self, url: str, *, queue_size: int | None = None, give_up_after: float = 30.0,
                 retry_for: float = 30.0, pool_size: int = 8, read_only: bool = False) -> None:
        self.url = url
        self._conninfo, self.schema, self.shown = parse_url(url)
        self._psycopg, self._pool_module = _psycopg()
        try:  # libpq's own check of the URL's parameters, before anything connects
            given = self._psycopg.conninfo.conninfo_to_dict(self._conninfo)
        except self._psycopg.ProgrammingError as exc:
            raise ConfigurationError(f"store URL {self.shown}: {str(exc).strip()[:200]}; libpq's URL parameters are "
                                     "listed at https://www.postgresql.org/docs/current/libpq-connect.html") from None
        #: What the connections are given besides the URL: the schema, and a name a DBA can see them by.
        self._options = {"options": f"-c search_path={self.schema}" + (
            " -c default_transaction_read_only=on" if read_only else ""), "connect_timeout": 10}
        if "application_name" not in given:
            self._options["application_name"] = "lightning-rl"
        self.read_only = read_only
        self._retry_for = retry_for
        self._pool_size = pool_size
        settings = Settings.from_env()
        self._queue_size = queue_size or settings.queue_size
        self._give_up_after = give_up_after
        self._closed = False
        self._bell = task_queue.Bell()  # rung by the LISTEN thread (queue.Listener)
        self._listener: pgq.Listener | None = None
        self._listen_lock = threading.Lock()
        self._open()
        track(self)

    def _connect(self, *, autocommit: bool = True) -> Any:
        try:
            return self._psycopg.connect(self._conninfo, autocommit=autocommit, **self._options)
        except self._psycopg.OperationalError as exc:
            problem = str(exc).strip()[:300]
            fix = ("; give the password in PGPASSWORD or ~/.pgpass (or in the URL)"
                   if "password" in problem.lower() else "")
            raise StoreError(f"cannot connect to the store {self.shown}: {problem}{fix}") from None

    def _open(self) -> None:
        conn = self._connect()
        try:
            if self.read_only:
                found = check_version(conn, self.schema, self.shown)
                if found != latest_version():
                    raise StoreError(f"{self.shown} has store schema {found}, not this lightning-rl's "
                                     f"({latest_version()}); a read-only open does not create or migrate it. Open it "
                                     "once with open_store(url) (or `lightning-rl store migrate`), then again")
            else:
                #: The schema version found (0: a new store); ``store migrate`` says it.
                self.schema_found = migrate(conn, self.schema, self.shown)
        finally:
            conn.close()
        self._pool = self._pool_module.ConnectionPool(
            self._conninfo, min_size=1, max_size=self._pool_size, open=True, timeout=self._retry_for,
            kwargs={"autocommit": True, **self._options}, name=f"lightning-rl:{self.shown}")
        self._wconn: Any = None
        self._durable: DurableWrites | None = None
        if not self.read_only:
            self._durable = DurableWrites(
                where=self.shown, doctor=f"lightning-rl store doctor --store {self.shown}",
                folder=_spill_folder(self.url, self.schema), apply=self._apply, keep_aside=self._keep_aside,
                is_record_error=is_record_error, queue_size=self._queue_size, give_up_after=self._give_up_after,
                name=f"lightning-rl-writer:{self.shown}")
        self._writer = None if self._durable is None else self._durable.writer

    @property
    def _where(self) -> str:
        return self.shown

    # -- connections ---------------------------------------------------------------------------------
    def _writer_conn(self) -> Any:
        """The writer thread's own connection, made again after the database went away."""
        if self._wconn is None or self._wconn.closed or self._wconn.broken:
            if self._wconn is not None:
                self._wconn.close()
            self._wconn = self._connect()
        return self._wconn

    def _with(self, fn: Callable[[Any], T], *, what: str) -> T:
        """``fn(conn)`` on a pooled connection, retried for ``retry_for`` seconds while the database cannot
        be reached (``fn`` must be idempotent); then :class:`StoreError`."""
        deadline = time.monotonic() + self._retry_for
        delay = 0.05
        while True:
            try:
                with self._pool.connection() as conn:
                    return fn(conn)
            except self._psycopg.errors.ReadOnlySqlTransaction:
                raise checks.read_only(what, self.shown) from None
            except (self._psycopg.OperationalError, self._pool_module.PoolTimeout) as exc:
                if time.monotonic() >= deadline:
                    raise StoreError(f"{what}: the store {self.shown} cannot be reached ({str(exc).strip()[:300]}); "
                                     f"tried for {self._retry_for:g} s") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _txn(self, fn: Callable[[Any], T], *, what: str) -> T:
        def run(conn: Any) -> T:
            with conn.transaction():
                return fn(conn)

        return self._with(run, what=what)

    # -- the writer thread --------------------------------------------------------------------------
    def _apply(self, ops: list[Op], sharer: Any) -> list[str]:
        return sql.apply_ops(self._writer_conn(), ops, sharer)

    def _keep_aside(self, note: Quarantine) -> bool:
        conn = self._writer_conn()
        with conn.transaction(), conn.cursor() as cur:
            return sql.insert_quarantine(cur, note)

    @property
    def spill_files(self) -> list[Path]:
        """Spill files waiting to be written back (read-only: every one in the folder, whoever owns it)."""
        if self._durable is None:
            folder = _spill_folder(self.url, self.schema)
            return spill_files_in(folder)
        return list(self._durable.spills.files)

    def delete_rollouts(self, rollout_ids: Iterable[str], *, full: bool = False) -> int:
        """Erase rollouts (``store/erasure.py``): DELETE in one transaction, then ``VACUUM`` of the tables
        (``full``: ``VACUUM FULL`` and a ``CHECKPOINT``, which rewrite the table files without their bytes)."""
        ids = rollout_id_list(rollout_ids)
        if self._durable is None:
            raise checks.read_only("delete_rollouts", self.shown)
        if not ids:
            return 0
        removed = self._durable.erase(ids, lambda: self._txn(lambda conn: delete_postgres(conn, ids),
                                                                what="delete_rollouts"))
        self._with(lambda conn: vacuum_postgres(conn, full=full), what="delete_rollouts (VACUUM)")
        return erased(removed)

    def quarantined(self, *, limit: int = 1000) -> list[QuarantinedRecord]:
        checks.check_count(limit, "limit")
        return self._with(lambda conn: sql.read_quarantine(conn, limit), what="quarantined")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._listen_lock:
            if self._listener is not None:
                self._listener.close()
        if self._durable is not None:
            self._durable.close()
        if self._wconn is not None:
            self._wconn.close()
        self._pool.close()

    def _after_fork(self) -> None:
        """In a forked child: its own connections and writer (the parent's are not this process's)."""
        from ..spill import forget_claims

        forget_claims()
        self._open()

    # -- RolloutReader ------------------------------------------------------------------------------
    def get_rollout(self, rollout_id: str) -> Rollout:
        rollout = self._with(lambda conn: sql.get_rollout(conn, rollout_id), what="get_rollout")
        if rollout is None:
            raise checks.not_found(rollout_id, self.shown)
        return rollout

    def rollouts(self, *, mode: str | None = None, status: str | RolloutStatus | None = None,
                 since: float | dt.datetime | None = None, min_policy_version: int | None = None,
                 limit: int | None = None, newest_first: bool = False) -> list[Rollout]:
        mode, status, since = checks.rollout_filters(mode, status, since, min_policy_version, limit)
        return self._with(lambda conn: sql.query_rollouts(
            conn, mode=mode, status=status, since=since, min_policy_version=min_policy_version, limit=limit,
            newest_first=newest_first), what="rollouts")

    def rollout_page(self, query: RolloutQuery | None = None, **filters: Any) -> RolloutPage:
        query = checks.rollout_query(query, filters)
        return self._txn(lambda conn: sql.rollout_page(conn, query), what="rollout_page")  # one snapshot

    def spans(self, rollout_id: str) -> list[Span]:
        self.get_rollout(rollout_id)
        return self._with(lambda conn: sql.spans_of(conn, rollout_id), what="spans")

    def rewards(self, rollout_id: str) -> list[Reward]:
        self.get_rollout(rollout_id)
        return self._with(lambda conn: sql.rewards_of(conn, rollout_id), what="rewards")

    def rollout_data(self, rollout_ids: Sequence[str]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        ids = list(rollout_ids)
        for start in range(0, len(ids), 50):  # a few rollouts a query: a long rollout's tokens are large unpacked
            chunk = ids[start:start + 50]
            found = {r.rollout_id: (r, s, w) for r, s, w in self._txn(
                lambda conn: list(sql.data_of(conn, chunk)), what="rollout_data")}
            for rollout_id in chunk:
                if rollout_id not in found:
                    raise checks.not_found(rollout_id, self.shown)
                yield found[rollout_id]

    # -- RolloutIndex -------------------------------------------------------------------------------
    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]:
        ids = list(rollout_ids)
        return self._with(lambda conn: sql.existing_ids(conn, ids), what="existing_rollout_ids")

    def rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        return self._with(lambda conn: sql.ids_with_prefix(conn, prefix, limit), what="rollout_ids_with_prefix")

    def llm_call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        return self._with(lambda conn: sql.llm_call_counts(conn, rollout_ids), what="llm_call_counts")

    def last_activity(self, rollout_id: str) -> float | None:
        return self._with(lambda conn: sql.last_activity(conn, rollout_id), what="last_activity")

    # -- RewardLog ----------------------------------------------------------------------------------
    def rewarded_since(self, after: int = 0, *, name: str | None = None, limit: int = 10_000) -> tuple[list[str], int]:
        checks.check_position(after)
        checks.check_count(limit, "limit")
        rows = self._with(lambda conn: sql.rewards_after(conn, after, name, limit), what="rewarded_since")
        return list(dict.fromkeys(rid for _, rid in rows)), (rows[-1][0] if rows else after)

    # -- PolicyLog ----------------------------------------------------------------------------------
    def record_policy(self, served_name: str, version: int, *, adapter: str | None = None,
                      time: float | None = None, trained_on: Sequence[str] | None = None,
                      served_as: str | None = None) -> PolicyRecord:
        if self._durable is None:
            raise checks.read_only("record_policy", self.shown)
        record = checks.policy_record(served_name, version, adapter=adapter, time=time, trained_on=trained_on,
                                      served_as=served_as)

        def insert(conn: Any) -> None:
            with conn.cursor() as cur:  # a retry after a lost commit finds its own record: kept once
                cur.execute("SELECT 1 FROM policies WHERE served_name = %s AND version = %s AND time = %s",
                            (record.served_name, record.version, record.time))
                if cur.fetchone() is None:
                    sql.insert_policy(cur, record)

        self._txn(insert, what="record_policy")
        return record

    def policies(self, served_name: str | None = None) -> list[PolicyRecord]:
        return self._with(lambda conn: sql.query_policies(conn, served_name), what="policies")

    def latest_policies(self) -> dict[str, PolicyRecord]:
        return {p.served_name: p for p in self._with(lambda conn: sql.query_policies(conn, None, latest=True),
                                                     what="latest_policies")}

    def record_decision(self, served_name: str, version: int, decision: str, *, live_version: int | None = None,
                        adapter: str | None = None, figures: Mapping[str, Any] | None = None,
                        reason: str | None = None, time: float | None = None) -> PolicyDecision:
        if self._durable is None:
            raise checks.read_only("record_decision", self.shown)
        record = checks.decision_record(served_name, version, decision, live_version=live_version, adapter=adapter,
                                        figures=figures, reason=reason, time=time)

        def insert(conn: Any) -> None:
            with conn.cursor() as cur:  # a retry after a lost commit finds its own record: kept once
                cur.execute("SELECT 1 FROM decisions WHERE served_name = %s AND version = %s AND decision = %s AND "
                            "time = %s", (record.served_name, record.version, record.decision.value, record.time))
                if cur.fetchone() is None:
                    sql.insert_decision(cur, record)

        self._txn(insert, what="record_decision")
        return record

    def decisions(self, served_name: str | None = None) -> list[PolicyDecision]:
        return self._with(lambda conn: sql.query_decisions(conn, served_name), what="decisions")

    def latest_decisions(self) -> dict[str, PolicyDecision]:
        return {d.served_name: d for d in self._with(lambda conn: sql.query_decisions(conn, None, latest=True),
                                                     what="latest_decisions")}
