"""Schema migrations for the SQLite store, registered by decorator and recorded in the database.

``PRAGMA application_id`` marks a file as ours; ``PRAGMA user_version`` is the schema version; the
``_lightning_rl_migrations`` table records which migrations ran and when. Migrating is safe to
re-run and safe when several processes open a new file at once (one ``BEGIN IMMEDIATE`` transaction).

``MIGRATIONS`` is a :class:`~lightning_rl.registry.Registry` keyed by schema version: ``@migration(16,
"what it adds")`` registers the next one. Versions run 1, 2, 3, ... with no gap: a version registered
twice, or one that is not the latest plus one, is refused (``ConfigurationError``) when the module loads.
A migration never changes once released: a store written by it must still open, so a fix is a new one.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

import orjson
import sqlite_utils

from ...diagnostics import logger
from ...errors import NotAStoreError, SchemaTooNewError
from ...registry import Registry
from ..kit.migrations import add_migration, migration_registry

APPLICATION_ID = 0x4C524C31  # "LRL1"
MIGRATIONS_TABLE = "_lightning_rl_migrations"

Migration = Callable[[sqlite_utils.Database], None]
#: schema version -> the function that brings a store from the version before to it; its ``title`` trait is
#: what ``_lightning_rl_migrations`` records
MIGRATIONS: Registry[Migration] = migration_registry("SQLite store migration", "lightning_rl/store/sqlite/migrations.py")


def migration(version: int, name: str) -> Callable[[Migration], Migration]:
    """Register ``fn`` as the migration to schema ``version`` (the latest plus one), titled ``name``.
    Returns ``fn`` unchanged (``kit/migrations.py``: a gap or a version twice is refused)."""
    return add_migration(MIGRATIONS, version, name)


def latest_version() -> int:
    return max(MIGRATIONS.names())


@migration(1, "initial: rollouts, spans, rewards")
def _initial(db: sqlite_utils.Database) -> None:
    db["rollouts"].create(
        {
            "rollout_id": str, "name": str, "agent": str, "task": str, "group_id": str,
            "attempt": int, "mode": str, "status": str, "policy_version": int,
            "start_time": float, "end_time": float, "error": str,
        },
        pk="rollout_id",
        not_null={"name", "attempt", "mode", "status", "start_time"},
    )
    db["rollouts"].create_index(["mode", "start_time"], index_name="rollouts_mode_start")
    db["spans"].create(
        {
            "rollout_id": str, "seq": int, "trace_id": str, "span_id": str, "parent_id": str,
            "name": str, "kind": str, "start_ns": int, "end_ns": int, "status_code": str,
            "status_message": str, "attributes": str, "events": str,
        },
        not_null={"rollout_id", "seq", "trace_id", "span_id", "name", "kind", "start_ns", "end_ns",
                  "status_code", "attributes"},
    )
    # One row per (rollout, seq): a retried batch can never duplicate a span.
    db["spans"].create_index(["rollout_id", "seq"], index_name="spans_rollout_seq", unique=True)
    db["rewards"].create(
        {
            "reward_id": int, "rollout_id": str, "name": str, "value": float,
            "llm_call_index": int, "agent": str, "source": str, "time": float,
        },
        pk="reward_id",
        not_null={"rollout_id", "name", "value", "source", "time"},
    )
    db["rewards"].create_index(["rollout_id"], index_name="rewards_rollout")


@migration(2, "task queue")
def _task_queue(db: sqlite_utils.Database) -> None:
    db["queue"].create(
        {
            "queue_id": str, "group_id": str, "task": str, "attempt": int, "mode": str, "status": str,
            "runner": str, "lease_expires": float, "tries": int, "max_tries": int, "rollout_id": str,
            "outcome": str, "created": float,
        },
        pk="queue_id",
        not_null={"group_id", "attempt", "mode", "status", "tries", "max_tries", "created"},
    )
    db["queue"].create_index(["status", "created"], index_name="queue_status_created")
    db["queue"].create_index(["group_id"], index_name="queue_group")


@migration(3, "reward uids (idempotent reward writes)")
def _reward_uids(db: sqlite_utils.Database) -> None:
    db["rewards"].add_column("uid", str)
    db.execute("UPDATE rewards SET uid = lower(hex(randomblob(16))) WHERE uid IS NULL")
    db["rewards"].create_index(["uid"], index_name="rewards_uid", unique=True)


@migration(4, "policies: every publish of a served model's weights")
def _policies(db: sqlite_utils.Database) -> None:
    db["policies"].create(
        {"publish_id": int, "served_name": str, "version": int, "adapter": str, "time": float},
        pk="publish_id",
        not_null={"served_name", "version", "time"},
    )
    db["policies"].create_index(["served_name", "publish_id"], index_name="policies_name")


@migration(5, "packed, prefix-shared token arrays beside span attributes")
def _packed_tokens(db: sqlite_utils.Database) -> None:
    from ..rows import lift_token_attributes, token_values
    from ..tokens import PrefixSharer

    spans = db["spans"]
    for name, kind in (("prompt_base_seq", int), ("prompt_shared", int), ("prompt_ids", bytes),
                       ("response_ids", bytes), ("response_logprobs", bytes)):
        if name not in spans.columns_dict:
            spans.add_column(name, kind)
    conn = db.conn
    sharer = PrefixSharer()
    marker = '"lightning_rl.prompt_token_ids"'
    rollout_ids = [r[0] for r in conn.execute(
        "SELECT DISTINCT rollout_id FROM spans WHERE instr(attributes, ?) > 0", (marker,)).fetchall()]
    for rollout_id in rollout_ids:  # one rollout at a time: memory stays bounded by the largest rollout
        rows = conn.execute("SELECT rowid, seq, attributes FROM spans WHERE rollout_id = ? AND instr(attributes, ?) > 0 "
                            "ORDER BY seq", (rollout_id, marker)).fetchall()
        updates = []
        for rowid, seq, attributes in rows:
            rest, packed = lift_token_attributes(orjson.loads(attributes))
            if packed is not None:
                shared = sharer.share((rollout_id, seq, *([None] * 11), *token_values(packed), None, None, None, None))
                updates.append((orjson.dumps(rest).decode(), *shared[13:18], rowid))
        conn.executemany("UPDATE spans SET attributes = ?, prompt_base_seq = ?, prompt_shared = ?, prompt_ids = ?, "
                         "response_ids = ?, response_logprobs = ? WHERE rowid = ?", updates)
        sharer.forget(rollout_id)


def _user_tables(conn: sqlite3.Connection) -> list[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")
    return [r[0] for r in rows]


def check_is_store(conn: sqlite3.Connection, path: str) -> None:
    """Refuse files that are not lightning-rl stores, before anything is written to them."""
    own_transaction = not conn.in_transaction  # both reads from one snapshot: another process may be
    try:                                         # committing a new store between them
        if own_transaction:
            conn.execute("BEGIN")
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            tables = _user_tables(conn)
        finally:
            if own_transaction and conn.in_transaction:
                conn.execute("COMMIT")
    except sqlite3.DatabaseError as exc:
        raise NotAStoreError(
            f"{path!r} is not a SQLite database ({exc}); give lightning-rl a new file name or an "
            "existing lightning-rl store (sqlite:///runs.db)"
        ) from None
    if app_id == APPLICATION_ID or (app_id == 0 and not tables):
        return
    shown = ", ".join(tables[:8]) + (", ..." if len(tables) > 8 else "")
    raise NotAStoreError(
        f"{path!r} is a SQLite database that lightning-rl did not create (application_id={app_id}, "
        f"tables: {shown or 'none'}); refusing to write to it. Use a new file for the store."
    )


def migrate(conn: sqlite3.Connection, path: str) -> int:
    """Bring the schema up to date; return the version. Raises ``SchemaTooNewError`` untouched."""
    latest = latest_version()
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > latest:
        raise SchemaTooNewError(
            f"{path!r} has store schema version {version}, newer than this lightning-rl understands "
            f"({latest}); upgrade lightning-rl (pip install -U lightning-rl) to open it"
        )
    if version == latest:
        return version
    conn.execute("BEGIN IMMEDIATE")
    try:
        check_is_store(conn, path)  # another process may have created it meanwhile
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > latest:
            raise SchemaTooNewError(f"{path!r} was upgraded to schema {version} by a newer lightning-rl")
        db = sqlite_utils.Database(conn)
        if MIGRATIONS_TABLE not in _user_tables(conn):
            conn.execute(f"CREATE TABLE {MIGRATIONS_TABLE} (version INTEGER PRIMARY KEY, name TEXT, applied_at REAL)")
        for target in (v for v in MIGRATIONS.names() if v > version):
            MIGRATIONS.get(target)(db)
            conn.execute(
                f"INSERT OR REPLACE INTO {MIGRATIONS_TABLE} VALUES (?, ?, ?)",
                (target, MIGRATIONS.trait(target, "title"), time.time()),
            )
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {latest}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if version > 0:  # an existing store changed under its user's feet: said, not silent
        logger.warning(
            "lightning-rl: upgraded the store %r from schema %d to %d (a lightning-rl before this one can no longer "
            "open it). Space the upgrade freed stays in the file until `lightning-rl store migrate --vacuum --store "
            "%s` gives it back", path, version, latest, path)
    return latest


@migration(6, "queue lease keys (a retried lease request gets the entries it leased)")
def _lease_keys(db: sqlite_utils.Database) -> None:
    if "lease_key" not in db["queue"].columns_dict:
        db["queue"].add_column("lease_key", str)


@migration(7, "policy lineage: the rollout groups each published version was trained on")
def _policy_lineage(db: sqlite_utils.Database) -> None:
    if "trained_on" not in db["policies"].columns_dict:  # a JSON list of group ids; NULL: not recorded
        db["policies"].add_column("trained_on", str)


@migration(8, "rollout origin (gateway-opened rollouts a restarted gateway may end); start-time indexes")
def _rollout_origin(db: sqlite_utils.Database) -> None:
    if "origin" not in db["rollouts"].columns_dict:
        db["rollouts"].add_column("origin", str)
    indexes = {i.name for i in db["rollouts"].indexes}
    if "rollouts_start" not in indexes:  # the newest-first list (viewer, rollouts ls) without a full sort
        db["rollouts"].create_index(["start_time"], index_name="rollouts_start")
    if "rollouts_status_start" not in indexes:  # running rollouts (the orphan sweep), status filters
        db["rollouts"].create_index(["status", "start_time"], index_name="rollouts_status_start")


@migration(9, "quarantine: records that could not be written, with the reason and their original form")
def _quarantine(db: sqlite_utils.Database) -> None:
    if "quarantine" in db.table_names():
        return
    db["quarantine"].create(
        {"quarantine_id": int, "time": float, "kind": str, "rollout_id": str, "reason": str, "payload": str,
         "digest": str},
        pk="quarantine_id",
        not_null={"time", "kind", "reason", "payload", "digest"},
    )
    # A batch retried after a lock can meet the same bad record again: it is kept once.
    db["quarantine"].create_index(["digest"], index_name="quarantine_digest", unique=True)


@migration(10, "message text beside span attributes, prefix-shared like token ids")
def _shared_messages(db: sqlite_utils.Database) -> None:
    from ..rows import lift_messages
    from ..tokens import PrefixSharer

    spans = db["spans"]
    for name, kind in (("input_base_seq", int), ("input_shared", int), ("input_messages", str),
                       ("output_messages", str)):
        if name not in spans.columns_dict:
            spans.add_column(name, kind)
    conn = db.conn
    sharer = PrefixSharer()
    markers = ('"gen_ai.input.messages"', '"gen_ai.output.messages"')
    where = "(instr(attributes, ?) > 0 OR instr(attributes, ?) > 0)"
    rollout_ids = [r[0] for r in conn.execute(f"SELECT DISTINCT rollout_id FROM spans WHERE {where}", markers)]
    for rollout_id in rollout_ids:  # one rollout at a time: memory stays bounded by the largest rollout
        rows = conn.execute(f"SELECT rowid, seq, attributes FROM spans WHERE rollout_id = ? AND {where} ORDER BY seq",
                            (rollout_id, *markers)).fetchall()
        updates = []
        for rowid, seq, attributes in rows:
            try:
                rest, text = lift_messages(orjson.loads(attributes))
            except orjson.JSONDecodeError:  # kept as it was; readers skip and count it
                continue
            if text[2] is None and text[3] is None:
                continue
            shared = sharer.share((rollout_id, seq, *([None] * 16), *text))
            updates.append((orjson.dumps(rest).decode(), *shared[18:], rowid))
        conn.executemany("UPDATE spans SET attributes = ?, input_base_seq = ?, input_shared = ?, input_messages = ?, "
                         "output_messages = ? WHERE rowid = ?", updates)
        sharer.forget(rollout_id)


@migration(11, "each rollout keeps the sum and count of its 'reward' rewards (the viewer's reward pages read a column)")
def _reward_sums(db: sqlite_utils.Database) -> None:
    conn = db.conn
    columns = db["rollouts"].columns_dict
    if "reward_sum" not in columns:
        conn.execute("ALTER TABLE rollouts ADD COLUMN reward_sum REAL")
    if "reward_count" not in columns:
        conn.execute("ALTER TABLE rollouts ADD COLUMN reward_count INTEGER NOT NULL DEFAULT 0")
    conn.execute("UPDATE rollouts SET (reward_sum, reward_count) = (SELECT sum(value), count(*) FROM rewards w "
                 "WHERE w.rollout_id = rollouts.rollout_id AND w.name = 'reward')")
    conn.execute("CREATE INDEX IF NOT EXISTS rollouts_reward ON rollouts (reward_sum)")
    # Kept by the database itself, so every writer (and a reward inserted twice, ignored) keeps them right:
    # a new 'reward' adds to its rollout; a rollout stored after its rewards (a replayed spill) counts them.
    conn.execute("CREATE TRIGGER IF NOT EXISTS rewards_sum AFTER INSERT ON rewards WHEN NEW.name = 'reward' BEGIN "
                 "UPDATE rollouts SET reward_sum = coalesce(reward_sum, 0) + NEW.value, "
                 "reward_count = reward_count + 1 WHERE rollout_id = NEW.rollout_id; END")
    conn.execute("CREATE TRIGGER IF NOT EXISTS rollouts_sum AFTER INSERT ON rollouts "
                 "WHEN EXISTS (SELECT 1 FROM rewards WHERE rollout_id = NEW.rollout_id AND name = 'reward') BEGIN "
                 "UPDATE rollouts SET (reward_sum, reward_count) = (SELECT sum(value), count(*) FROM rewards "
                 "WHERE rollout_id = NEW.rollout_id AND name = 'reward') WHERE rollout_id = NEW.rollout_id; END")


@migration(12, "policy decisions: the gate's figures, promotions, refusals and rollbacks, next to the publishes")
def _decisions(db: sqlite_utils.Database) -> None:
    db.conn.execute("CREATE TABLE IF NOT EXISTS decisions (decision_id INTEGER PRIMARY KEY, served_name TEXT NOT NULL, "
                    "version INTEGER NOT NULL, decision TEXT NOT NULL, live_version INTEGER, adapter TEXT, "
                    "figures TEXT NOT NULL, reason TEXT, time FLOAT NOT NULL)")
    db.conn.execute("CREATE INDEX IF NOT EXISTS decisions_name ON decisions (served_name, decision_id)")


@migration(13, "queued tries carry what their runner runs them with (endpoint, sampling: verl's external rollouts)")
def _queue_overrides(db: sqlite_utils.Database) -> None:
    if "overrides" not in db["queue"].columns_dict:
        db["queue"].add_column("overrides", str)


@migration(14, "the queue's expiry sweep and a retried lease read only the rows they need (a lease costs the same "
               "with 100,000 tries in flight as with 1,000)")
def _queue_lease_indexes(db: sqlite_utils.Database) -> None:
    conn = db.conn
    # whole indexes led by status (not partial ones): without ANALYZE statistics SQLite's planner takes the
    # index that matches the most terms, so these win over (status, created) for the sweep and the retry
    conn.execute("CREATE INDEX IF NOT EXISTS queue_leased_expiry ON queue (status, lease_expires)")
    conn.execute("CREATE INDEX IF NOT EXISTS queue_leased_key ON queue (status, runner, lease_key)")
    conn.execute("CREATE INDEX IF NOT EXISTS queue_status_order ON queue (status, created, attempt)")


@migration(15, "publishes name the version-specific name every serving replica serves them under (served_as)")
def _policies_served_as(db: sqlite_utils.Database) -> None:
    if "served_as" not in db["policies"].columns_dict:  # NULL: loaded in place under the served name only
        db["policies"].add_column("served_as", str)
