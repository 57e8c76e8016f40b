"""The PostgreSQL store's SQL: a batch of ops in one transaction, the reads, the queue's locked view.

Each function runs on a connection its caller holds (psycopg 3, ``search_path`` set to the store's
schema). The rows are the SQLite store's (``rows.py``), so the writer's prefix sharing and every reader
are shared; only the SQL differs:

* Inserts are idempotent (``ON CONFLICT DO NOTHING``): a batch retried on another store server, after a
  lost answer, changes nothing.
* A transaction that adds rewards holds an advisory lock from before its first insert to its commit,
  so reward ids are given in commit order across every process writing the database: a poller of
  ``rewarded_since`` never skips a reward that committed late with a lower id.
* The task queue's rules (``task_queue.py``) run on a view whose reads lock the rows they return:
  ``lease`` takes ``FOR UPDATE SKIP LOCKED`` (two runners, on two servers or connected directly, never
  get the same try), ``heartbeat`` and ``complete`` wait for the row (``FOR UPDATE``); a group queued
  ``once`` is serialized by an advisory lock on its id.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ... import semconv
from ...diagnostics import count
from ...records import (
    PolicyDecision,
    PolicyRecord,
    QueueEntry,
    QueueStatus,
    Reward,
    Rollout,
    RolloutPage,
    RolloutQuery,
    RolloutStatus,
    Span,
    allowed_from,
)
from ..kit import rollout_sql
from ..kit.batch import sort_ops
from ..ops import FinishRollout, Op, Quarantine
from .schema import LOCK_REWARDS
from ..rows import (
    DECISION_COLUMNS,
    decision_from_row,
    decision_values,
    QUEUE_COLUMNS,
    REWARD_COLUMNS,
    ROLLOUT_COLUMNS,
    SPAN_COLUMNS,
    queue_from_values,
    queue_values,
    reward_from_values,
    reward_values,
    rollout_values,
    rollouts_from_rows,
    spans_from_rows,
)
from ..tokens import PrefixSharer


def _insert(table: str, columns: Sequence[str], conflict: str = "") -> str:
    marks = ", ".join(["%s"] * len(columns))
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}) ON CONFLICT {conflict}DO NOTHING"


INSERT_SPAN = _insert("spans", SPAN_COLUMNS)
INSERT_ROLLOUT = _insert("rollouts", ROLLOUT_COLUMNS)
INSERT_REWARD = _insert("rewards", REWARD_COLUMNS)
_UPSERT_QUEUE = (f"INSERT INTO queue ({', '.join(QUEUE_COLUMNS)}) VALUES ({', '.join(['%s'] * len(QUEUE_COLUMNS))}) "
                 f"ON CONFLICT (queue_id) DO UPDATE SET "
                 + ", ".join(f"{c} = excluded.{c}" for c in QUEUE_COLUMNS if c != "queue_id"))
_TIMED_OUT = RolloutStatus.TIMED_OUT.value
_FINISH = ("UPDATE rollouts SET status = %s, end_time = %s, error = %s, policy_version = coalesce(%s, policy_version) "
           "WHERE rollout_id = %s AND status = ANY(%s)")
_NUL = "\x00"


def clean_text(values: tuple) -> tuple:
    """A row whose strings PostgreSQL can hold: its text type has no NUL character (SQLite's has), so a NUL is
    stored as U+FFFD and counted (``text_nul_replaced``); everything else is kept as it is."""
    for v in values:  # a plain loop: a third cheaper than any() over a generator, on every row written
        if type(v) is str and _NUL in v:
            count("text_nul_replaced")
            return tuple(v.replace(_NUL, "\ufffd") if type(v) is str else v for v in values)
    return values


def apply_ops(conn: Any, ops: Iterable[Op], sharer: PrefixSharer) -> list[str]:
    """Write ``ops`` in one transaction, in the SQLite store's order: starts, spans (prefix-shared by
    ``sharer``), rewards, finishes, the queue's expiries (its word is final), then quarantine notes.
    Returns the rollouts that finished.

    New rows go in by binary ``COPY`` (a fraction of the server's and the writer's CPU that a row-by-row
    ``INSERT`` costs); a batch of which a row is there already (a retry after a lost answer, a spill written
    back, a late start of an expired try) fails that ``COPY`` on its unique key and is written again, whole,
    by ``INSERT ... ON CONFLICT DO NOTHING`` (counted: ``pg_batches_rewritten``)."""
    batch = sort_ops(ops)
    share = sharer.share
    rows = _Rows(rollouts=[clean_text(rollout_values(r)) for r in batch.rollouts],
                 spans=[clean_text(share(values)) for values in batch.spans],
                 rewards=[clean_text(reward_values(r)) for r in batch.rewards],
                 finishes=batch.finishes, expires=batch.expires, notes=batch.notes)
    try:
        _write(conn, rows, copy=True)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) != _UNIQUE_VIOLATION:
            raise
        count("pg_batches_rewritten")
        _write(conn, rows, copy=False)
    return [op.rollout_id for op in rows.finishes]


_UNIQUE_VIOLATION = "23505"


@dataclass(slots=True)
class _Rows:
    """A batch's rows by table, in op order."""

    rollouts: list[tuple] = field(default_factory=list)
    spans: list[tuple] = field(default_factory=list)
    rewards: list[tuple] = field(default_factory=list)
    finishes: list[FinishRollout] = field(default_factory=list)
    expires: list[Rollout] = field(default_factory=list)
    notes: list[Quarantine] = field(default_factory=list)


def _write(conn: Any, rows: _Rows, *, copy: bool) -> None:
    """One transaction: new rows by ``COPY`` (``copy``: fails on a row that is there already) or by
    ``INSERT ... ON CONFLICT DO NOTHING``; the finishes pipelined, each counted when its transition is refused."""
    with conn.transaction(), conn.cursor() as cur:
        if rows.rewards:  # first: reward ids in commit order (module doc)
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_REWARDS,))
        for table, insert, values in (("rollouts", INSERT_ROLLOUT, rows.rollouts), ("spans", INSERT_SPAN, rows.spans),
                                      ("rewards", INSERT_REWARD, rows.rewards)):
            if not values:
                continue
            if copy:
                _copy(cur, table, values)
            else:
                cur.executemany(insert, values)
        if rows.finishes:
            cur.executemany(_FINISH, [(RolloutStatus(op.status).value, op.end_time,
                                       None if op.error is None else op.error.replace(_NUL, "\ufffd"), op.policy_version,
                                       op.rollout_id, sorted(s.value for s in allowed_from(op.status)))
                                      for op in rows.finishes], returning=True)
            while True:  # one result per finish
                if cur.rowcount == 0:
                    count("rejected_status_transitions")
                if not cur.nextset():
                    break
        for tombstone in rows.expires:
            expire_try(cur, tombstone)
        for note in rows.notes:
            insert_quarantine(cur, note)


_COPY_COLUMNS = {"rollouts": ROLLOUT_COLUMNS, "spans": SPAN_COLUMNS, "rewards": REWARD_COLUMNS}
_COPY_SQL = {table: f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)"
             for table, columns in _COPY_COLUMNS.items()}
_column_types: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()


def _copy(cur: Any, table: str, values: list[tuple]) -> None:
    """``values`` into ``table`` by binary ``COPY``; the columns' types are read from the catalog once per
    connection (binary COPY needs them; the schema's own, whatever its migrations made them)."""
    types = _column_types.get(cur.connection)
    if types is None:
        types = _column_types[cur.connection] = _catalog_types(cur)
    with cur.copy(_COPY_SQL[table]) as copy:
        copy.set_types(types[table])
        write = copy.write_row
        for row in values:
            write(row)


def _catalog_types(cur: Any) -> dict[str, list[int]]:
    cur.execute("SELECT c.relname, a.attname, a.atttypid::int FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                "WHERE c.oid = ANY(ARRAY['rollouts'::regclass, 'spans'::regclass, 'rewards'::regclass]) "
                "AND a.attnum > 0 AND NOT a.attisdropped")
    found: dict[tuple[str, str], int] = {(t, c): oid for t, c, oid in cur.fetchall()}
    return {table: [found[table, column] for column in columns] for table, columns in _COPY_COLUMNS.items()}


def expire_try(cur: Any, tombstone: Rollout) -> None:
    """The queue gave up on a try: its rollout is ``timed_out`` (the tombstone's row if it never started),
    final whatever its runner reports later (the lifecycle refuses a move out of ``timed_out``)."""
    cur.execute(INSERT_ROLLOUT, clean_text(rollout_values(tombstone)))
    cur.execute("UPDATE rollouts SET status = %s, end_time = %s, error = %s WHERE rollout_id = %s AND status <> %s",
                (_TIMED_OUT, tombstone.end_time, tombstone.error, tombstone.rollout_id, _TIMED_OUT))


def insert_quarantine(cur: Any, note: Quarantine) -> bool:
    """A row of the ``quarantine`` table (in the caller's transaction); False if it was there already."""
    from ..quarantine import digest_of

    text = note.payload.encode("utf-8", "surrogatepass").decode("utf-8", "replace").replace(_NUL, "\ufffd")
    cur.execute("INSERT INTO quarantine (time, kind, rollout_id, reason, payload, digest) "
                "VALUES (extract(epoch from clock_timestamp()), %s, %s, %s, %s, %s) ON CONFLICT (digest) DO NOTHING",
                (note.what, note.rollout_id if isinstance(note.rollout_id, str) else None,
                 note.reason.replace(_NUL, "\ufffd"), text, digest_of(note.what, note.payload)))
    return cur.rowcount > 0


def insert_policy(cur: Any, record: PolicyRecord) -> None:
    cur.execute("INSERT INTO policies (served_name, version, adapter, time, trained_on, served_as) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                (record.served_name, record.version, record.adapter, record.time,
                 None if record.trained_on is None else orjson.dumps(record.trained_on).decode(), record.served_as))


def insert_decision(cur: Any, record: PolicyDecision) -> None:
    marks = ", ".join(["%s"] * len(DECISION_COLUMNS))
    cur.execute(f"INSERT INTO decisions ({', '.join(DECISION_COLUMNS)}) VALUES ({marks})", decision_values(record))


def query_decisions(conn: Any, served_name: str | None, *, latest: bool = False) -> list[PolicyDecision]:
    """In the order they were recorded; ``latest``: only the last decision about each name."""
    where, params = [], []
    if served_name is not None:
        where, params = ["served_name = %s"], [served_name]
    if latest:
        where.append("decision_id IN (SELECT max(decision_id) FROM decisions GROUP BY served_name)")
    sql = f"SELECT {', '.join(DECISION_COLUMNS)} FROM decisions"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return [decision_from_row(r) for r in _rows(conn, sql + " ORDER BY decision_id", params)]


# -- reads --------------------------------------------------------------------------------------------
_ROLLOUT = f"SELECT {', '.join(ROLLOUT_COLUMNS)} FROM rollouts"
_SPAN_COLUMNS = ", ".join(SPAN_COLUMNS)
_REWARD_COLUMNS = ", ".join(REWARD_COLUMNS)
_LLM_OPS = sorted(semconv.LLM_OPERATIONS)


def _rows(conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def get_rollout(conn: Any, rollout_id: str) -> Rollout | None:
    found = rollouts_from_rows(_rows(conn, f"{_ROLLOUT} WHERE rollout_id = %s", (rollout_id,)))
    return found[0] if found else None


def spans_of(conn: Any, rollout_id: str) -> list[Span]:
    return spans_from_rows(_rows(conn, f"SELECT {_SPAN_COLUMNS} FROM spans WHERE rollout_id = %s ORDER BY seq",
                                 (rollout_id,)))


def rewards_of(conn: Any, rollout_id: str) -> list[Reward]:
    return [reward_from_values(r) for r in _rows(
        conn, f"SELECT {_REWARD_COLUMNS} FROM rewards WHERE rollout_id = %s ORDER BY reward_id", (rollout_id,))]


def data_of(conn: Any, rollout_ids: Sequence[str]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
    """The rollouts of ``rollout_ids`` that exist, each with its spans and rewards, in three queries."""
    ids = list(rollout_ids)
    found = {r.rollout_id: r for r in rollouts_from_rows(_rows(conn, f"{_ROLLOUT} WHERE rollout_id = ANY(%s)", (ids,)))}
    spans: dict[str, list[tuple]] = {}
    for row in _rows(conn, f"SELECT {_SPAN_COLUMNS} FROM spans WHERE rollout_id = ANY(%s) ORDER BY rollout_id, seq",
                     (ids,)):
        spans.setdefault(row[0], []).append(row)
    rewards: dict[str, list[Reward]] = {}
    for row in _rows(conn, f"SELECT {_REWARD_COLUMNS} FROM rewards WHERE rollout_id = ANY(%s) ORDER BY reward_id",
                     (ids,)):
        rewards.setdefault(row[0], []).append(reward_from_values(row))
    for rollout_id in ids:
        if rollout_id in found:
            yield found[rollout_id], spans_from_rows(spans.get(rollout_id, [])), rewards.get(rollout_id, [])


def query_rollouts(conn: Any, *, mode: str | None, status: str | None, since: float | None,
                   min_policy_version: int | None, limit: int | None, newest_first: bool) -> list[Rollout]:
    st = rollout_sql.rollouts_statement(rollout_sql.POSTGRES, mode=mode, status=status, since=since,
                                        min_policy_version=min_policy_version, limit=limit, newest_first=newest_first)
    return rollouts_from_rows(_rows(conn, st.sql, st.params))


def rollout_page(conn: Any, query: RolloutQuery) -> RolloutPage:
    """As the SQLite store's (``kit/rollout_sql.py``; the reward sums are kept by the database's triggers,
    ``postgres/schema.py``). Text search ignores case."""
    count, rows = rollout_sql.page_statements(rollout_sql.POSTGRES, query)
    (total,), = _rows(conn, count.sql, count.params)
    return rollout_sql.page_from_rows(_rows(conn, rows.sql, rows.params), total)


def existing_ids(conn: Any, rollout_ids: Iterable[str]) -> set[str]:
    return {r[0] for r in _rows(conn, "SELECT rollout_id FROM rollouts WHERE rollout_id = ANY(%s)",
                                (list(rollout_ids),))}


def ids_with_prefix(conn: Any, prefix: str, limit: int) -> list[str]:
    return [r[0] for r in _rows(conn, "SELECT rollout_id FROM rollouts WHERE rollout_id >= %s AND rollout_id < %s "
                                      "ORDER BY rollout_id LIMIT %s", (prefix, prefix + "\U0010ffff", int(limit)))]


def llm_call_counts(conn: Any, rollout_ids: Sequence[str]) -> dict[str, int]:
    ids = list(rollout_ids)
    counts = dict.fromkeys(existing_ids(conn, ids), 0)
    counts.update({rid: n for rid, n in _rows(
        conn, "SELECT rollout_id, count(*) FROM spans WHERE rollout_id = ANY(%s) "
        "AND lightning_rl_json(attributes) ->> 'gen_ai.operation.name' = ANY(%s) GROUP BY rollout_id",
        (ids, _LLM_OPS))})
    return counts


def last_activity(conn: Any, rollout_id: str) -> float | None:
    (span_end, reward_time), = _rows(
        conn, "SELECT (SELECT max(end_ns) FROM spans WHERE rollout_id = %s), "
              "(SELECT max(time) FROM rewards WHERE rollout_id = %s)", (rollout_id, rollout_id))
    times = [t for t in ((span_end / 1e9) if span_end is not None else None, reward_time) if t is not None]
    return max(times) if times else None


def rewards_after(conn: Any, after: int, name: str | None, limit: int) -> list[tuple[int, str]]:
    sql, params = "SELECT reward_id, rollout_id FROM rewards WHERE reward_id > %s", [after]
    if name is not None:
        sql += " AND name = %s"
        params.append(name)
    return [tuple(r) for r in _rows(conn, sql + " ORDER BY reward_id LIMIT %s", (*params, int(limit)))]


def query_policies(conn: Any, served_name: str | None, *, latest: bool = False) -> list[PolicyRecord]:
    where, params = [], []
    if served_name is not None:
        where, params = ["served_name = %s"], [served_name]
    if latest:
        where.append("publish_id IN (SELECT max(publish_id) FROM policies GROUP BY served_name)")
    sql = "SELECT served_name, version, adapter, time, trained_on, served_as FROM policies"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return [PolicyRecord(served_name=n, version=v, adapter=a, time=t, trained_on=None if g is None else orjson.loads(g),
                         served_as=s) for n, v, a, t, g, s in _rows(conn, sql + " ORDER BY publish_id", params)]


def read_quarantine(conn: Any, limit: int) -> list[Any]:
    from ...records import QuarantinedRecord

    return [QuarantinedRecord(quarantine_id=q, time=t, kind=k, rollout_id=r, reason=why, payload=text)
            for q, t, k, r, why, text in _rows(
                conn, "SELECT quarantine_id, time, kind, rollout_id, reason, payload FROM quarantine "
                      "ORDER BY quarantine_id DESC LIMIT %s", (int(limit),))]


class QueueView:
    """The task queue's rows inside one transaction (``task_queue.QueueView``); reads lock the rows they
    return as ``lock`` says: ``"skip"`` (``FOR UPDATE SKIP LOCKED``: a lease), ``"wait"`` (``FOR UPDATE``:
    a heartbeat or a completion), or None (a plain read)."""

    def __init__(self, conn: Any, lock: str | None = None) -> None:
        self.conn = conn
        self.lock = {"skip": " FOR UPDATE SKIP LOCKED", "wait": " FOR UPDATE", None: ""}[lock]

    def select(self, *, status: Sequence[QueueStatus], group_ids: Sequence[str] | None = None,
               queue_id: str | None = None, limit: int | None = None) -> list[QueueEntry]:
        sql = f"SELECT {', '.join(QUEUE_COLUMNS)} FROM queue WHERE status = ANY(%s)"
        params: list[Any] = [[str(getattr(x, "value", x)) for x in status]]
        if group_ids is not None:
            sql += " AND group_id = ANY(%s)"
            params.append(list(group_ids))
        if queue_id is not None:
            sql += " AND queue_id = %s"
            params.append(queue_id)
        sql += " ORDER BY created, attempt"
        if limit is not None:
            sql += " LIMIT %s"
            params.append(limit)
        return [queue_from_values(r) for r in _rows(self.conn, sql + self.lock, params)]

    def put(self, entries: Iterable[QueueEntry]) -> None:
        rows = [clean_text(queue_values(e)) for e in entries]
        if rows:
            with self.conn.cursor() as cur:
                cur.executemany(_UPSERT_QUEUE, rows)
