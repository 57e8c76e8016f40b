"""SQLiteStore: the durable default. WAL mode, recorded migrations, one background writer per process.

* Spans, rollouts and rewards are queued to a background writer (bounded queue: a full queue
  blocks the producer, nothing is dropped) and written in batched transactions.
* A finishing rollout flushes, so it is on disk before the traced call returns.
* Several processes may write one file: WAL, ``BEGIN IMMEDIATE`` and a busy timeout; a retried
  batch cannot duplicate spans (unique ``(rollout_id, seq)``).
* A batch that cannot be written for ``give_up_after`` seconds (the file is locked, full, away) is
  spilled to ``<db>.spill/*.jsonl``, and so is everything after it, in order, until the writer has
  replayed the backlog (it tries every second while the store is open). A store opened later adopts
  the spill files of processes that are gone.
* A record that cannot be written for a reason in its own data (a value SQLite cannot bind, a spill
  line from another version) goes to the ``quarantine`` table with the reason and its original form;
  the rest of its batch is written (``quarantine.py``). Nothing is retried that can never succeed.
* ``read_only=True`` (the viewer): no writer, no migration, no spill adoption or replay; the
  connections are ``query_only``.
* Files that are not lightning-rl stores, or come from a newer schema, are refused untouched.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import orjson

from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, StoreError
from ..records import (PolicyRecord, QuarantinedRecord, Reward, Rollout, RolloutPage, RolloutQuery, RolloutRow,
                       RolloutStatus, Span, SpanRow, allowed_from)
from ..settings import Settings, check_synchronous
from .base import Store
from .lifecycle import track
from .connections import NETWORK_FILESYSTEMS, connect, filesystem_type
from .migrations import latest_version, migrate
from .quarantine import describe, insert_quarantine, is_record_error, read_quarantine
from .rows import (
    QUEUE_COLUMNS,
    REWARD_COLUMNS,
    ROLLOUT_COLUMNS,
    SPAN_COLUMNS,
    legacy_span_values,
    queue_from_values,
    queue_values,
    reward_from_values,
    reward_values,
    full_rollout_values,
    rollout_values,
    rollouts_from_rows,
    span_record_values,
    span_values,
    spans_from_rows,
    spill_item,
    spill_line,
)
from .spill import SpillFiles
from .tokens import PrefixSharer
from .writer import BackgroundWriter

_INSERT_SPAN = f"INSERT OR IGNORE INTO spans ({', '.join(SPAN_COLUMNS)}) VALUES ({', '.join('?' * len(SPAN_COLUMNS))})"
_INSERT_ROLLOUT = f"INSERT OR IGNORE INTO rollouts ({', '.join(ROLLOUT_COLUMNS)}) VALUES ({', '.join('?' * len(ROLLOUT_COLUMNS))})"
_INSERT_REWARD = f"INSERT OR IGNORE INTO rewards ({', '.join(REWARD_COLUMNS)}) VALUES ({', '.join('?' * len(REWARD_COLUMNS))})"

# Rows per multi-row INSERT: 22 columns x 16 rows stays far below SQLite's bound-parameter limit.
_CHUNK = 16
_INSERT_SPANS_CHUNK = _INSERT_SPAN.split(" VALUES ")[0] + " VALUES " + ", ".join(
    ["(" + ", ".join("?" * len(SPAN_COLUMNS)) + ")"] * _CHUNK
)


def _insert_many(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    """Insert span rows with one multi-row statement per chunk. ``executemany`` steps once per row
    and Python's sqlite3 releases the GIL around every step, which makes a writer thread fight the
    agent's thread for the GIL row by row; one step per 16 rows avoids most of that."""
    full = len(rows) - len(rows) % _CHUNK
    for start in range(0, full, _CHUNK):
        conn.execute(_INSERT_SPANS_CHUNK, [v for row in rows[start:start + _CHUNK] for v in row])
    if full < len(rows):
        conn.executemany(_INSERT_SPAN, rows[full:])


class SQLiteStore(Store):
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
        self._sharer = PrefixSharer()  # the writer thread's: prompts stored as prefix + tail
        self._spills = SpillFiles(Path(self.path + ".spill"))
        self._spills.adopt_orphans(own=_claim_spill_folder(self._spills.folder))
        self._writer = BackgroundWriter(
            self._apply, maxsize=self._queue_size, name=f"lightning-rl-writer:{Path(self.path).name}",
            spill=self._spill, replay=self._replay, backlog=lambda: bool(self._spills.files),
            give_up_after=self._give_up_after, quarantine=self._quarantine, is_record_error=is_record_error,
        )
        if self._spills.files:
            self._writer.flush(0)  # wakes the writer, which writes the backlog back first

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
        self._writer = None
        self._spills = SpillFiles(Path(self.path + ".spill"))  # never adopted, never replayed: only listed

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"{what}: the store {self.path!r} was opened read-only (the viewer's mode); open it "
                             "with open_store(url) to write")

    # -- sink (called by the tracer; never blocks except for back-pressure) -------------------------
    def start_rollout(self, rollout: Rollout) -> None:
        self._writable("start_rollout")
        self._writer.put("rollout", rollout)

    def write_span(self, row: SpanRow) -> None:
        self._writable("write_span")
        self._writer.put("span", row)

    def write_reward(self, reward: Reward) -> None:
        self._writable("write_reward")
        self._writer.put("reward", reward)

    def finish_rollout(self, rollout_id: str, status: RolloutStatus, end_time: float, error: str | None,
                       policy_version: int | None = None) -> None:
        self._writable("finish_rollout")
        self._writer.put("finish", (rollout_id, RolloutStatus(status).value, end_time, error, policy_version))

    def expire_rollout(self, entry, reason: str) -> None:
        self._writable("expire_rollout")
        tombstone = self._tombstone(entry, reason)
        self._writer.put("expire", (rollout_values(tombstone), tombstone.end_time, reason))

    def flush(self, timeout: float | None = None) -> bool:
        if self._closed or self._writer is None:
            return True
        return self._writer.flush(timeout)

    def write_batch(self, items: list[tuple[str, Any]]) -> None:
        """The store server's write path: returns once the items are in the database. Items kept in a
        spill file (the database is unwritable) are not acknowledged: StoreError, and the client retries
        (idempotently) after the backlog has been written back, so no later op overtakes them."""
        self._writable("write_batch")
        self._writer.put_many(items)
        if not self._writer.flush_applied(Settings.from_env().flush_timeout):
            raise StoreError(f"{len(items)} records are not in {self.path!r} yet (the database could not be written; "
                             "they are kept in its spill file and written back when it can be)")

    @property
    def spill_files(self) -> list[Path]:
        """Spill files waiting to be written back (read-only: every one in the folder, whoever owns it)."""
        if self.read_only:
            folder = self._spills.folder
            return sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
        return list(self._spills.files)

    @property
    def pending_writes(self) -> int:
        return self._writer.pending

    def existing_rollout_ids(self, rollout_ids) -> set[str]:
        ids = list(rollout_ids)
        found: set[str] = set()
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            rows = self._read(f"SELECT rollout_id FROM rollouts WHERE rollout_id IN ({', '.join('?' * len(chunk))})",
                              tuple(chunk))
            found.update(r[0] for r in rows)
        return found

    def add_spans(self, spans: list[Span]) -> None:
        """Ingest spans recorded elsewhere (batched, idempotent by (rollout_id, seq)); durable on return."""
        for span in spans:
            self._writer.put("span_values", span_record_values(span))
        if not self.flush(Settings.from_env().flush_timeout):
            raise StoreError(f"the spans are queued but were not confirmed on disk in {self.path!r} in time")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer is None:  # read-only
            self._rconn.close()
            return
        self._writer.close()
        if self._spills.files:
            try:
                self._replay()  # one last try; what stays is adopted by the next open
            except Exception as exc:
                report_failure("spill replay", exc)
        _release_spill_folder(self._spills.folder)
        for conn in (self._wconn, self._rconn, self._qconn):
            try:
                conn.close()
            except Exception:
                pass

    # -- the writer thread ------------------------------------------------------------------------
    def _apply(self, items: list[tuple[str, Any]]) -> None:
        rollouts, spans, rewards, finishes, expires, quarantined = [], [], [], [], [], []
        share = self._sharer.share
        for kind, payload in items:
            if kind == "span":
                spans.append(share(span_values(payload)))
            elif kind == "span_values":
                spans.append(share(legacy_span_values(payload)))
            elif kind == "rollout":
                rollouts.append(rollout_values(payload) if isinstance(payload, Rollout) else full_rollout_values(payload))
            elif kind == "reward":
                rewards.append(reward_values(payload) if isinstance(payload, Reward) else tuple(payload))
            elif kind == "finish":
                finishes.append(tuple(payload))
            elif kind == "expire":
                expires.append(payload)
            elif kind == "quarantine":  # set aside while spilling (it could not even be spilled as it was)
                quarantined.append(payload)
            else:  # a record kind this version does not know (a spill line of another version)
                raise ValueError(f"unknown record kind {kind!r:.60}")
        conn = self._wconn
        conn.execute("BEGIN IMMEDIATE")
        try:
            if rollouts:
                conn.executemany(_INSERT_ROLLOUT, rollouts)
            if spans:
                _insert_many(conn, spans)
            if rewards:
                conn.executemany(_INSERT_REWARD, rewards)
            for rollout_id, status, end_time, error, *version in finishes:  # spills before 0.1 have no version
                sources = sorted(s.value for s in allowed_from(status))
                marks = ", ".join("?" * len(sources))
                cur = conn.execute(
                    "UPDATE rollouts SET status = ?, end_time = ?, error = ?, policy_version = coalesce(?, policy_version) "
                    f"WHERE rollout_id = ? AND status IN ({marks})",
                    (status, end_time, error, version[0] if version else None, rollout_id, *sources),
                )
                if cur.rowcount == 0:
                    count("rejected_status_transitions")
            for values, end_time, reason in expires:  # the queue's word is final: after everything else
                conn.execute(_INSERT_ROLLOUT, full_rollout_values(values))
                conn.execute("UPDATE rollouts SET status = ?, end_time = ?, error = ? WHERE rollout_id = ? AND status != ?",
                             (RolloutStatus.TIMED_OUT.value, end_time, reason, values[0], RolloutStatus.TIMED_OUT.value))
            for rollout_id, reason, text, kind in quarantined:
                insert_quarantine(conn, kind, rollout_id, reason, text)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        for rollout_id, *_ in finishes:
            self._sharer.forget(rollout_id)

    def _spill(self, items: list[tuple[str, Any]]) -> None:
        lines = []
        for kind, payload in items:
            try:
                lines.append(spill_line(kind, payload))
            except Exception as exc:  # JSON cannot hold it: it waits, described, for the quarantine table
                rollout_id, reason, text = describe(kind, payload, exc)
                lines.append(spill_line("quarantine", [rollout_id, reason, text, kind]))
        self._spills.append(lines)
        report_failure("spill", message=f"lightning-rl: store {self.path!r} unwritable; records spilled to "
                                        f"{self._spills.folder} (written back, in order, when it can be)")

    def _replay(self) -> bool:
        """Write the spill files back, oldest first (writer thread). True when none is left. A line that
        is not a record this version can write (another version's, damaged) is quarantined, and so is a
        record the database refuses; everything else is written. Raises only while the file is unwritable."""
        while self._spills.files:
            path = self._spills.files[0]
            items = []
            for number, line in enumerate(SpillFiles.read(path), 1):
                try:
                    items.append(spill_item(line))
                except Exception as exc:  # not JSON, an unknown kind, a payload of another shape
                    text = line.decode(errors="replace")
                    items.append(("quarantine", [None, f"line {number} of spill file {path.name}: {exc}", text[:100_000],
                                                 "spill line"]))
            self._writer.write(items)
            path.unlink()
            self._spills.files.pop(0)
            count("spill_files_replayed")
        return True

    # -- the quarantine ---------------------------------------------------------------------------
    def _quarantine(self, item: tuple[str, Any], exc: BaseException) -> None:
        """Set aside one record the database refused for its own data (the writer's isolation)."""
        kind, payload = item
        if kind == "quarantine":  # its own row failed: store the description alone
            rollout_id, reason, text, kind = (list(payload) + [None] * 4)[:4] if isinstance(payload, list) else \
                (None, f"{type(exc).__name__}: {exc}", repr(payload)[:10_000], "quarantine")
        else:
            rollout_id, reason, text = describe(kind, payload, exc)
        if kind == "span":
            self._sharer.drop(payload.rollout_id, payload.seq)
        elif kind == "span_values" and isinstance(payload, (list, tuple)) and len(payload) > 1:
            self._sharer.drop(payload[0], payload[1])
        conn = self._wconn
        conn.execute("BEGIN IMMEDIATE")
        try:
            added = insert_quarantine(conn, str(kind), rollout_id, str(reason), str(text))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if added:
            count("records_quarantined")
            report_failure("record quarantined", message=(
                f"lightning-rl: a {kind} record could not be written to {self.path!r} ({reason[:300]}); it is kept in "
                "the store's quarantine with its original form and the rest of its batch was written. "
                f"`lightning-rl store doctor --store {self.path}` lists what is there (logged once)"))

    def _quarantined(self, limit: int) -> list[QuarantinedRecord]:
        with self._rlock:
            return read_quarantine(self._rconn, limit)

    def _after_fork(self) -> None:
        """In a forked child: fresh connections and writer; the parent writes what it had queued."""
        self._closed = False
        _spill_folders_in_use.clear()  # the parent's stores are not open in this process
        self._open()

    # -- task queue: synchronous, atomic across processes ------------------------------------------
    def _queue_txn(self, fn):
        if self.read_only:  # reads of the queue only; a write is refused by query_only, said as read-only
            with self._rlock:
                conn = self._rconn
                conn.execute("BEGIN")
                try:
                    return fn(_SQLiteQueueView(conn))
                except sqlite3.OperationalError as exc:
                    self._writable(f"the task queue ({exc})")
                    raise
                finally:
                    conn.execute("ROLLBACK")
        with self._qlock:
            conn = self._qconn
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(_SQLiteQueueView(conn))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return result

    # -- reads ------------------------------------------------------------------------------------
    def _read(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._rlock:
            return self._rconn.execute(sql, params).fetchall()

    def _get_rollout(self, rollout_id: str) -> Rollout | None:
        rows = self._read(f"SELECT {', '.join(ROLLOUT_COLUMNS)} FROM rollouts WHERE rollout_id = ?", (rollout_id,))
        found = rollouts_from_rows(rows)
        return found[0] if found else None

    def _query_rollouts(self, *, mode, status, since, min_policy_version, limit, newest_first) -> list[Rollout]:
        where, params = [], []
        for clause, value in (("mode = ?", mode), ("status = ?", status), ("start_time >= ?", since),
                              ("policy_version >= ?", min_policy_version)):
            if value is not None:
                where.append(clause)
                params.append(value)
        sql = f"SELECT {', '.join(ROLLOUT_COLUMNS)} FROM rollouts"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY start_time DESC, rowid DESC" if newest_first else " ORDER BY start_time, rowid"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return rollouts_from_rows(self._read(sql, tuple(params)))

    def _rollout_page(self, query: RolloutQuery) -> RolloutPage:
        """In SQL: filters on the rollouts' columns (indexed by mode and start), the reward sum joined
        only when it is filtered or sorted on; otherwise read for the page's rows alone."""
        where, params = [], []
        for column, value in (("mode", query.mode), ("status", query.status), ("agent", query.agent),
                              ("group_id", query.group_id), ("policy_version", query.policy_version)):
            if value is not None:
                where.append(f"r.{column} = ?")
                params.append(value.value if hasattr(value, "value") else value)
        if query.text:
            pattern = "%" + query.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where.append("(r.task LIKE ? ESCAPE '\\' OR r.rollout_id LIKE ? ESCAPE '\\')")
            params += [pattern, pattern]
        by_reward = query.sort == "reward" or query.reward_min is not None or query.reward_max is not None
        sums = ("(SELECT rollout_id, SUM(value) AS reward, COUNT(*) AS n FROM rewards WHERE name = 'reward' "
                "GROUP BY rollout_id)")
        source = f"rollouts r LEFT JOIN {sums} w ON w.rollout_id = r.rollout_id" if by_reward else "rollouts r"
        if query.reward_min is not None:
            where.append("w.reward >= ?")
            params.append(query.reward_min)
        if query.reward_max is not None:
            where.append("w.reward <= ?")
            params.append(query.reward_max)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        direction = "DESC" if query.descending else "ASC"
        column = "w.reward" if query.sort == "reward" else f"r.{query.sort}"
        # columns that are never NULL sort without the NULLs-last term, so an index can give the order
        nulls_last = "" if query.sort in ("start_time", "status", "mode", "rollout_id") else f"{column} IS NULL, "
        order = f"{nulls_last}{column} {direction}, r.start_time {direction}, r.rowid {direction}"
        columns = ", ".join(f"r.{c}" for c in ROLLOUT_COLUMNS)
        extra = ", w.reward, w.n" if by_reward else ""
        with self._rlock:
            total = self._rconn.execute(f"SELECT count(*) FROM {source}{clause}", params).fetchone()[0]
            found = self._rconn.execute(f"SELECT {columns}{extra} FROM {source}{clause} ORDER BY {order} LIMIT ? OFFSET ?",
                                        (*params, query.limit, query.offset)).fetchall()
            n = len(ROLLOUT_COLUMNS)
            if by_reward:
                rewards = {row[0]: (row[n], row[n + 1] or 0) for row in found}
            else:
                ids = [row[0] for row in found]
                marks = ", ".join("?" * len(ids))
                rewards = {rid: (total_, count_) for rid, total_, count_ in self._rconn.execute(
                    f"SELECT rollout_id, SUM(value), COUNT(*) FROM rewards WHERE name = 'reward' AND rollout_id IN "
                    f"({marks}) GROUP BY rollout_id", ids).fetchall()} if ids else {}
        rows = [RolloutRow(rollout=rollout, reward=rewards.get(rollout.rollout_id, (None, 0))[0],
                           rewards=rewards.get(rollout.rollout_id, (None, 0))[1])
                for rollout in rollouts_from_rows([row[:n] for row in found])]
        return RolloutPage(rows=rows, total=total)

    def _last_activity(self, rollout: Rollout) -> float:
        """Without reading the spans' token columns (the gateway's orphan sweep asks every minute)."""
        (span_end,), = self._read("SELECT max(end_ns) FROM spans WHERE rollout_id = ?", (rollout.rollout_id,))
        (reward_time,), = self._read("SELECT max(time) FROM rewards WHERE rollout_id = ?", (rollout.rollout_id,))
        return max(rollout.start_time, (span_end or 0) / 1e9, reward_time or 0.0)

    def _rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        rows = self._read("SELECT rollout_id FROM rollouts WHERE rollout_id >= ? AND rollout_id < ? ORDER BY rollout_id "
                          "LIMIT ?", (prefix, prefix + "\U0010ffff", int(limit)))
        return [r[0] for r in rows]

    def llm_call_counts(self, rollout_ids) -> dict[str, int]:
        ids = list(rollout_ids)
        counts = dict.fromkeys(self.existing_rollout_ids(ids), 0)
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            rows = self._read(
                "SELECT rollout_id, count(*) FROM spans WHERE rollout_id IN (" + ", ".join("?" * len(chunk)) + ") "
                "AND CASE WHEN json_valid(attributes) THEN json_extract(attributes, '$.\"gen_ai.operation.name\"') END "
                "IN ('chat', 'text_completion') "
                "GROUP BY rollout_id", tuple(chunk))
            counts.update({rid: n for rid, n in rows})
        return counts

    def _get_spans(self, rollout_id: str) -> list[Span]:
        rows = self._read(f"SELECT {', '.join(SPAN_COLUMNS)} FROM spans WHERE rollout_id = ? ORDER BY seq", (rollout_id,))
        return spans_from_rows(rows)

    def _get_rewards(self, rollout_id: str) -> list[Reward]:
        rows = self._read(f"SELECT {', '.join(REWARD_COLUMNS)} FROM rewards WHERE rollout_id = ? ORDER BY reward_id", (rollout_id,))
        return [reward_from_values(r) for r in rows]

    def _insert_reward(self, reward: Reward) -> None:
        self._writer.put("reward", reward)
        if not self.flush(Settings.from_env().flush_timeout):
            raise StoreError(f"reward for {reward.rollout_id!r} queued but not confirmed on disk in {self.path!r} in time")

    def _rewards_after(self, after: int, name: str | None, limit: int) -> list[tuple[int, str]]:
        sql = "SELECT reward_id, rollout_id FROM rewards WHERE reward_id > ?"
        params: tuple = (after,)
        if name is not None:
            sql, params = sql + " AND name = ?", (after, name)
        return [tuple(r) for r in self._read(sql + " ORDER BY reward_id LIMIT ?", (*params, int(limit)))]

    def _insert_policy(self, record: PolicyRecord) -> None:
        def insert(view: _SQLiteQueueView) -> None:
            view._conn.execute(
                "INSERT INTO policies (served_name, version, adapter, time, trained_on) VALUES (?, ?, ?, ?, ?)",
                (record.served_name, record.version, record.adapter, record.time,
                 None if record.trained_on is None else orjson.dumps(record.trained_on).decode()))
        self._queue_txn(insert)

    def _query_policies(self, served_name: str | None, latest: bool = False) -> list[PolicyRecord]:
        where, params = [], []
        if served_name is not None:
            where, params = ["served_name = ?"], [served_name]
        if latest:
            where.append("publish_id IN (SELECT max(publish_id) FROM policies GROUP BY served_name)")
        sql = "SELECT served_name, version, adapter, time, trained_on FROM policies"
        if where:
            sql += " WHERE " + " AND ".join(where)
        params = tuple(params)
        rows = self._read(sql + " ORDER BY publish_id", params)
        return [PolicyRecord(served_name=n, version=v, adapter=a, time=t,
                             trained_on=None if g is None else orjson.loads(g)) for n, v, a, t, g in rows]


# Spill folders of stores open in this process: a store opened on a folder nobody here uses may take
# this process's own leftover files too (a store closed with a backlog, then opened again).
_spill_folders_in_use: set[Path] = set()
_spill_folders_lock = threading.Lock()


def _claim_spill_folder(folder: Path) -> bool:
    with _spill_folders_lock:
        first = folder not in _spill_folders_in_use
        _spill_folders_in_use.add(folder)
        return first


def _release_spill_folder(folder: Path) -> None:
    with _spill_folders_lock:
        _spill_folders_in_use.discard(folder)


class _SQLiteQueueView:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def select(self, *, status, group_ids=None, queue_id=None, limit=None):
        statuses = [str(getattr(x, "value", x)) for x in status]
        sql = f"SELECT {', '.join(QUEUE_COLUMNS)} FROM queue WHERE status IN ({', '.join('?' * len(statuses))})"
        params: list[Any] = list(statuses)
        if group_ids is not None:
            sql += f" AND group_id IN ({', '.join('?' * len(group_ids))})"
            params += list(group_ids)
        if queue_id is not None:
            sql += " AND queue_id = ?"
            params.append(queue_id)
        sql += " ORDER BY created, attempt"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [queue_from_values(r) for r in self._conn.execute(sql, params).fetchall()]

    def put(self, entries) -> None:
        rows = [queue_values(e) for e in entries]
        if rows:
            self._conn.executemany(
                f"INSERT OR REPLACE INTO queue ({', '.join(QUEUE_COLUMNS)}) VALUES ({', '.join('?' * len(QUEUE_COLUMNS))})",
                rows,
            )

