"""SQLite's (and PostgreSQL's) migrations are a registry keyed by schema version: 1, 2, 3, ... with no gap and
no version twice (refused when registered, naming the number to use), and what each is titled is what a store
records."""

from __future__ import annotations

import sqlite3

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.registry import Registry
from lightning_rl.store import SQLiteStore
from lightning_rl.store.sqlite.migrations import MIGRATIONS, MIGRATIONS_TABLE, latest_version, migration


def test_the_migrations_are_one_registry_numbered_without_gaps():
    assert isinstance(MIGRATIONS, Registry) and MIGRATIONS.key is int
    assert MIGRATIONS.names() == list(range(1, latest_version() + 1))
    assert MIGRATIONS.trait(3, "title") == "reward uids (idempotent reward writes)"


def test_a_gap_or_a_version_twice_is_refused_naming_the_next_number():
    latest = latest_version()
    with pytest.raises(ConfigurationError, match=rf"SQLite store migration {latest + 2} \('later'\) would leave a gap: "
                                                 rf"the latest is {latest}; number it {latest + 1}"):
        migration(latest + 2, "later")
    with pytest.raises(ConfigurationError, match=r"SQLite store migration 3 is registered already \('reward uids "
                                                 rf"\(idempotent reward writes\)'\); number the new one {latest + 1}"):
        migration(3, "again")
    with pytest.raises(ConfigurationError, match="a SQLite store migration is registered under an integer, got '16'"):
        migration("16", "a string")
    assert MIGRATIONS.names() == list(range(1, latest + 1))  # nothing was added


def test_a_new_store_records_each_migration_under_its_title(tmp_path):
    SQLiteStore(tmp_path / "runs.db").close()
    conn = sqlite3.connect(tmp_path / "runs.db")
    rows = conn.execute(f"SELECT version, name FROM {MIGRATIONS_TABLE} ORDER BY version").fetchall()
    conn.close()
    assert rows == [(version, MIGRATIONS.trait(version, "title")) for version in range(1, latest_version() + 1)]
    assert rows[0] == (1, "initial: rollouts, spans, rewards")


def test_postgresql_migrations_keep_the_same_rule_and_a_new_schema_records_their_titles(pg_url):
    """The same kit rule (``store/kit/migrations.py``) for PostgreSQL, and what a fresh schema records."""
    import psycopg

    from lightning_rl.store import open_store
    from lightning_rl.store.postgres import schema
    from lightning_rl.store.postgres.connection import DEFAULT_SCHEMA

    assert schema.MIGRATIONS.key is int and schema.MIGRATIONS.names() == list(range(1, schema.latest_version() + 1))
    latest = schema.latest_version()
    with pytest.raises(ConfigurationError, match=rf"PostgreSQL store migration {latest + 2} \('later'\) would leave "
                                                 rf"a gap: the latest is {latest}; number it {latest + 1}"):
        schema.migration(latest + 2, "later")
    with pytest.raises(ConfigurationError, match=rf"PostgreSQL store migration 1 is registered already .*; number "
                                                 rf"the new one {latest + 1}"):
        schema.migration(1, "again")
    open_store(pg_url).close()
    with psycopg.connect(pg_url.split("?")[0]) as conn:
        table = f'"{DEFAULT_SCHEMA}".{schema.MIGRATIONS_TABLE}'
        rows = conn.execute(f"SELECT version, name FROM {table} ORDER BY version").fetchall()
    assert rows == [(v, schema.MIGRATIONS.trait(v, "title")) for v in range(1, latest + 1)]
