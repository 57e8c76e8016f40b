"""The PostgreSQL store's schema: recorded migrations, in a PostgreSQL schema of the store's own.

The tables and columns are the SQLite store's (``sqlite/migrations.py``, schema 10), with PostgreSQL types and
text compared byte by byte (``COLLATE "C"``, SQLite's BINARY: the same order, and prefix ranges on ids):
the same row tuples (``rows.py``) go in and come out, so every reader and the writer's prefix sharing
are shared. They live in a schema of their own (``lightning_rl`` by default, ``?schema=NAME`` in the
URL), so a database that holds other tables is fine, and two stores can share one database.

As in SQLite, migrations are registered by decorator, run in one transaction, recorded in
``_lightning_rl_migrations`` and safe when several processes (store servers starting together) open a
new database at once: a transaction-level advisory lock orders them. A schema that holds tables but no
marker of ours is refused untouched (``NotAStoreError``); one written by a newer lightning-rl too
(``SchemaTooNewError``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...diagnostics import logger
from ...errors import NotAStoreError, SchemaTooNewError
from ...registry import Registry
from ..kit.migrations import add_migration, migration_registry

MIGRATIONS_TABLE = "_lightning_rl_migrations"
MARKER_TABLE = "_lightning_rl_store"
#: ``pg_advisory_xact_lock`` keys (arbitrary 64-bit constants: "LRL" and a purpose).
LOCK_MIGRATE = 0x4C524C00_00000001
LOCK_REWARDS = 0x4C524C00_00000002
LOCK_GROUPS = 0x4C524C03  # with the group id's hash: pg_advisory_xact_lock(int, int)

#: schema version -> ``fn(cursor)`` bringing a store from the version before to it; its ``title`` trait is what
#: ``_lightning_rl_migrations`` records (``kit/migrations.py``: 1, 2, 3, ... with no gap, none twice)
MIGRATIONS: Registry[Callable[[Any], None]] = migration_registry(
    "PostgreSQL store migration", "lightning_rl/store/postgres/schema.py")


def migration(version: int, name: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register ``fn(cursor)`` as the migration to schema ``version`` (the latest plus one); returns it unchanged."""
    return add_migration(MIGRATIONS, version, name)


def latest_version() -> int:
    return max(MIGRATIONS.names())


#: Text compared byte by byte, as SQLite's BINARY collation (module doc).
T = 'text COLLATE "C"'


@migration(1, "rollouts (with their reward sums), spans (packed, prefix-shared tokens and messages), rewards, queue, "
              "policies, quarantine")
def _initial(cur: Any) -> None:
    cur.execute(f"""
        CREATE TABLE rollouts (
            rollout_id {T} PRIMARY KEY, name {T} NOT NULL, agent {T}, task {T}, group_id {T},
            attempt bigint NOT NULL, mode {T} NOT NULL, status {T} NOT NULL, policy_version bigint,
            start_time double precision NOT NULL, end_time double precision, error {T}, origin {T},
            reward_sum double precision, reward_count bigint NOT NULL DEFAULT 0,
            row_order bigint GENERATED ALWAYS AS IDENTITY)""")
    cur.execute("CREATE INDEX rollouts_mode_start ON rollouts (mode, start_time)")
    cur.execute("CREATE INDEX rollouts_start ON rollouts (start_time, row_order)")
    cur.execute("CREATE INDEX rollouts_status_start ON rollouts (status, start_time)")
    cur.execute("CREATE INDEX rollouts_group ON rollouts (group_id)")
    cur.execute("CREATE INDEX rollouts_reward ON rollouts (reward_sum)")
    cur.execute(f"""
        CREATE TABLE spans (
            rollout_id {T} NOT NULL, seq bigint NOT NULL, trace_id {T} NOT NULL, span_id {T} NOT NULL,
            parent_id {T}, name {T} NOT NULL, kind {T} NOT NULL, start_ns bigint NOT NULL, end_ns bigint NOT NULL,
            status_code {T} NOT NULL, status_message {T}, attributes {T} NOT NULL, events {T},
            prompt_base_seq bigint, prompt_shared bigint, prompt_ids bytea, response_ids bytea,
            response_logprobs bytea, input_base_seq bigint, input_shared bigint, input_messages {T},
            output_messages {T},
            PRIMARY KEY (rollout_id, seq))""")
    cur.execute(f"""
        CREATE TABLE rewards (
            reward_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, rollout_id {T} NOT NULL, name {T} NOT NULL,
            value double precision NOT NULL, llm_call_index bigint, agent {T}, source {T} NOT NULL,
            time double precision NOT NULL, uid {T} UNIQUE)""")
    cur.execute("CREATE INDEX rewards_rollout ON rewards (rollout_id)")
    cur.execute(f"""
        CREATE TABLE queue (
            queue_id {T} PRIMARY KEY, group_id {T} NOT NULL, task {T}, attempt bigint NOT NULL, mode {T} NOT NULL,
            status {T} NOT NULL, runner {T}, lease_expires double precision, tries bigint NOT NULL,
            max_tries bigint NOT NULL, rollout_id {T}, outcome {T}, created double precision NOT NULL,
            lease_key {T})""")
    cur.execute("CREATE INDEX queue_status_created ON queue (status, created)")
    cur.execute("CREATE INDEX queue_group ON queue (group_id)")
    cur.execute(f"""
        CREATE TABLE policies (
            publish_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, served_name {T} NOT NULL,
            version bigint NOT NULL, adapter {T}, time double precision NOT NULL, trained_on {T})""")
    cur.execute("CREATE INDEX policies_name ON policies (served_name, publish_id)")
    cur.execute(f"""
        CREATE TABLE quarantine (
            quarantine_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, time double precision NOT NULL,
            kind {T} NOT NULL, rollout_id {T}, reason {T} NOT NULL, payload {T} NOT NULL, digest {T} NOT NULL UNIQUE)""")
    # JSON text that may not parse (attributes are stored as written): NULL instead of an error, so one
    # bad row never fails a query over many (SQLite's json_valid guard).
    cur.execute("""
        CREATE FUNCTION lightning_rl_json(value text) RETURNS jsonb LANGUAGE plpgsql IMMUTABLE AS $$
        BEGIN RETURN value::jsonb; EXCEPTION WHEN others THEN RETURN NULL; END $$""")
    # Each rollout's sum and count of its 'reward' rewards, kept by the database (the viewer's reward pages
    # read a column instead of aggregating every reward), as SQLite's migration 11: a new reward adds to its
    # rollout (a reward stored twice is not inserted, so not added); a rollout stored after its rewards counts them.
    cur.execute("""
        CREATE FUNCTION lightning_rl_reward_added() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
        BEGIN
            UPDATE rollouts SET reward_sum = coalesce(reward_sum, 0) + NEW.value, reward_count = reward_count + 1
            WHERE rollout_id = NEW.rollout_id;
            RETURN NULL;
        END $$""")
    cur.execute("CREATE TRIGGER rewards_sum AFTER INSERT ON rewards FOR EACH ROW WHEN (NEW.name = 'reward') "
                "EXECUTE FUNCTION lightning_rl_reward_added()")
    cur.execute("""
        CREATE FUNCTION lightning_rl_rollout_added() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM rewards WHERE rollout_id = NEW.rollout_id AND name = 'reward') THEN
                UPDATE rollouts SET (reward_sum, reward_count) = (SELECT sum(value), count(*) FROM rewards
                    WHERE rollout_id = NEW.rollout_id AND name = 'reward') WHERE rollout_id = NEW.rollout_id;
            END IF;
            RETURN NULL;
        END $$""")
    cur.execute("CREATE TRIGGER rollouts_sum AFTER INSERT ON rollouts FOR EACH ROW "
                "EXECUTE FUNCTION lightning_rl_rollout_added()")


@migration(2, "policy decisions: the gate's figures, promotions, refusals and rollbacks, next to the publishes")
def _decisions(cur: Any) -> None:
    cur.execute(f"""
        CREATE TABLE decisions (
            decision_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, served_name {T} NOT NULL,
            version bigint NOT NULL, decision {T} NOT NULL, live_version bigint, adapter {T}, figures {T} NOT NULL,
            reason {T}, time double precision NOT NULL)""")
    cur.execute("CREATE INDEX decisions_name ON decisions (served_name, decision_id)")


@migration(3, "queued tries carry what their runner runs them with (endpoint, sampling: verl's external rollouts)")
def _queue_overrides(cur: Any) -> None:
    cur.execute(f"ALTER TABLE queue ADD COLUMN overrides {T}")


@migration(4, "the queue's expiry sweep and a retried lease read only the rows they need (a lease costs the same "
              "with 100,000 tries in flight as with 1,000)")
def _queue_lease_indexes(cur: Any) -> None:
    cur.execute("CREATE INDEX queue_leased_expiry ON queue (lease_expires) WHERE status = 'leased'")
    cur.execute("CREATE INDEX queue_leased_key ON queue (runner, lease_key) WHERE status = 'leased'")
    cur.execute("CREATE INDEX queue_status_order ON queue (status, created, attempt)")


@migration(5, "publishes name the version-specific name every serving replica serves them under (served_as)")
def _policies_served_as(cur: Any) -> None:
    cur.execute(f"ALTER TABLE policies ADD COLUMN served_as {T}")


def _tables(cur: Any, schema: str) -> list[str]:
    cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s ORDER BY table_name",
                (schema,))
    return [r[0] for r in cur.fetchall()]


def _version(cur: Any, schema: str) -> int | None:
    """The schema version recorded in ``schema``; 0 when it is empty or absent; None when it holds tables
    that are not a store's."""
    tables = _tables(cur, schema)
    if not tables:
        return 0
    if MARKER_TABLE not in tables:
        return None
    cur.execute(f'SELECT value FROM "{schema}".{MARKER_TABLE} WHERE key = %s', ("schema_version",))
    row = cur.fetchone()
    return int(row[0]) if row else 0


def _refuse_foreign(cur: Any, schema: str, where: str) -> None:
    tables = _tables(cur, schema)
    shown = ", ".join(tables[:8]) + (", ..." if len(tables) > 8 else "")
    raise NotAStoreError(f"the PostgreSQL schema {schema!r} of {where} holds tables that lightning-rl did not create "
                         f"({shown}); refusing to write to it. Give the store a schema of its own "
                         "(postgresql://.../DB?schema=NAME) or a new database")


def check_version(conn: Any, schema: str, where: str) -> int:
    """The recorded version of the store in ``schema`` (0: none yet); refuses a foreign or newer one."""
    with conn.cursor() as cur:
        version = _version(cur, schema)
    if version is None:
        with conn.cursor() as cur:
            _refuse_foreign(cur, schema, where)
    if version > latest_version():
        raise SchemaTooNewError(f"{where} has store schema version {version} (PostgreSQL), newer than this lightning-rl "
                                f"understands ({latest_version()}); upgrade lightning-rl (pip install -U lightning-rl)")
    return version


def migrate(conn: Any, schema: str, where: str) -> int:
    """Bring the store in ``schema`` up to date (creating the schema), in one transaction; returns the version
    found before (0: a new store). ``conn`` is in autocommit mode."""
    found = check_version(conn, schema, where)
    latest = latest_version()
    if found == latest:
        return found
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_MIGRATE,))
        cur.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        found = _version(cur, schema)  # another process may have migrated it meanwhile
        if found is None:
            _refuse_foreign(cur, schema, where)
        if found > latest:
            raise SchemaTooNewError(f"{where} was upgraded to store schema {found} by a newer lightning-rl")
        cur.execute(f'SET LOCAL search_path TO "{schema}"')
        if found == 0:
            cur.execute(f"CREATE TABLE {MARKER_TABLE} (key text PRIMARY KEY, value text NOT NULL)")
            cur.execute(f"CREATE TABLE {MIGRATIONS_TABLE} (version integer PRIMARY KEY, name text NOT NULL, "
                        "applied_at double precision NOT NULL)")
        for target in (v for v in MIGRATIONS.names() if v > found):
            MIGRATIONS.get(target)(cur)
            cur.execute(f"INSERT INTO {MIGRATIONS_TABLE} VALUES (%s, %s, %s)",
                        (target, MIGRATIONS.trait(target, "title"), time.time()))
        cur.execute(f"INSERT INTO {MARKER_TABLE} VALUES ('schema_version', %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(latest),))
    if found > 0:
        logger.warning("lightning-rl: upgraded the store %s from schema %d to %d (PostgreSQL; a lightning-rl before this "
                       "one can no longer open it)", where, found, latest)
    return found
