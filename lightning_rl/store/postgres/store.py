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
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ...errors import ConfigurationError, MissingDependencyError, StoreError
from ...records import (
    PolicyDecision,
    PolicyRecord,
    QuarantinedRecord,
    QueueEntry,
    Reward,
    Rollout,
    RolloutPage,
    RolloutQuery,
    RolloutStatus,
    Span,
)
from ...settings import Settings, spill_dir
from .. import checks, task_queue
from . import queue as pgq
from . import sql
from ..durable import DurableWrites
from ..erasure import erased, rollout_id_list
from .erasure import delete_postgres, vacuum_postgres
from ..spill import spill_files_in
from ..kit.base import KitStore
from ..lifecycle import track
from ..ops import Op, Quarantine
from .schema import LOCK_GROUPS, check_version, latest_version, migrate
from ..uri import redacted

T = TypeVar("T")
DEFAULT_SCHEMA = "lightning_rl"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
SCHEMES = ("postgresql://", "postgres://")


def _psycopg() -> tuple[Any, Any]:
    try:
        import psycopg
        import psycopg_pool
    except ImportError:
        raise MissingDependencyError("a postgresql:// store needs psycopg 3; install it with: "
                                     "pip install 'lightning-rl[postgres]'") from None
    return psycopg, psycopg_pool


def parse_url(url: str) -> tuple[str, str, str]:
    """``(conninfo, schema, shown)``: the URL libpq connects with, the PostgreSQL schema of the store's
    tables (``?schema=NAME``), and the URL as messages show it (no password)."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not parts.path.strip("/"):
        raise ConfigurationError(f"store URL {redacted(url)!r:.200} is not postgresql://USER@HOST:PORT/DATABASE")
    try:
        parts.port
    except ValueError as exc:
        raise ConfigurationError(f"store URL {redacted(url)!r:.200}: {exc}; write postgresql://USER@HOST:5432/DATABASE") \
            from None
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next((v for k, v in query if k == "schema"), DEFAULT_SCHEMA)
    if not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(f"schema={schema!r:.80} in the store URL is not a PostgreSQL name of lowercase letters, "
                                 "digits and underscores, at most 63, starting with a letter or _; e.g. "
                                 "?schema=lightning_rl")
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, rest, ""))
    host = parts.hostname or "localhost"
    user = f"{parts.username}@" if parts.username else ""
    shown = f"postgresql://{user}{host}{f':{parts.port}' if parts.port else ''}{parts.path}" + (
        f"?schema={schema}" if schema != DEFAULT_SCHEMA else "")
    return conninfo, schema, shown


def _spill_folder(url: str, schema: str) -> Path:
    configured = spill_dir()
    if configured:
        return Path(configured)
    parts = urlsplit(url)
    name = f"pg_{parts.hostname or 'localhost'}_{parts.port or 5432}_{parts.path.strip('/')}_{schema}"
    return Path.home() / ".cache" / "lightning-rl" / "spill" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def is_record_error(exc: BaseException) -> bool:
    """True when a write failed for the records themselves (a value PostgreSQL refuses, a constraint, text it
    cannot encode); False when the database could not be written at all (unreachable, restarting, full, a
    conflict between transactions): retried, then spilled."""
    psycopg, _ = _psycopg()
    if isinstance(exc, (psycopg.errors.DataError, psycopg.errors.IntegrityError)):
        return True
    if isinstance(exc, (psycopg.Error, OSError, MemoryError, StoreError)):  # StoreError: the writer's reconnect
        return False
    return True  # Python's own refusal of the values (an encoding error, a type it cannot adapt)


class PostgresStore(KitStore):
    """A store in a PostgreSQL database (module doc; the sink funnel and ingest are the kit's, ``kit/base.py``)."""

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

    # -- TaskQueue (atomic in the database, across every process that opens it) -----------------------
    def _queue(self, lock: str | None = None, group: str | None = None, notify: bool = False) -> task_queue.Txn:
        """The queue's transactions, each on a view that locks as ``lock`` says (``sql.QueueView``);
        ``group``: serialize with any other transaction queuing that group id; ``notify``: wake every
        process's waiting leases at commit (``postgres/queue.py``)."""

        def txn(fn: Callable[[Any], T]) -> T:
            def run(conn: Any) -> T:
                if group is not None:
                    with conn.cursor() as cur:
                        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_GROUPS, group))
                result = fn(sql.QueueView(conn, lock))
                if notify:
                    pgq.notify(conn, self.schema)
                return result

            return self._txn(run, what="the task queue")

        return txn

    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False,
                overrides: Mapping[str, Any] | None = None) -> list[QueueEntry]:
        """As every store's. Without a ``group_id`` one is made and the call is ``once``: a retry after a lost
        answer does not queue the task twice."""
        if self._durable is None:
            raise checks.read_only("enqueue", self.shown)
        if group_id is None:
            group_id, once = uuid.uuid4().hex, True
        return task_queue.enqueue_in(self._queue(group=group_id if once else None, notify=True), task, n=n, mode=mode,
                                     max_tries=max_tries, group_id=group_id, once=once, overrides=overrides)

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None, wait: float = 0.0) -> list[QueueEntry]:
        """As every store's, in one statement on the database's clock (``postgres/queue.py``); an expired try's
        rollout is marked ``timed_out`` in the lease's own transaction (atomic with its retry: no process that
        dies in between can leave it running). ``wait``: woken by the database's NOTIFY of an enqueue."""
        task_queue.check_lease(lease_seconds, limit)
        key = key or uuid.uuid4().hex

        def lease_now() -> list[QueueEntry]:
            return self._txn(lambda conn: pgq.lease(conn, self.schema, runner, lease_seconds, limit, key),
                             what="the task queue")

        if not wait:
            return lease_now()
        task_queue.check_wait(wait)
        with self._listen_lock:
            if self._listener is None and not self._closed:
                self._listener = pgq.Listener(self._connect, self.schema, self._bell, self.shown)
        return task_queue.lease_waiting(lease_now, wait, self._bell)

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0) -> bool:
        """Extends the lease from the database's clock, not this process's."""
        task_queue.check_lease(lease_seconds, 1)

        def beat(conn: Any) -> bool:
            with conn.cursor() as cur:
                cur.execute(pgq.HEARTBEAT, (float(lease_seconds), queue_id, runner))
                return cur.rowcount > 0

        return self._with(beat, what="the task queue")

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str) -> bool:
        self.flush()  # the records written so far go first
        return task_queue.complete_in(self._queue("wait"), queue_id, runner, outcome)

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        return task_queue.entries_in(self._queue(), group_ids)

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
