"""SQLite's migrations are a registry keyed by schema version: 1, 2, 3, ... with no gap and no version twice
(refused when registered, naming the number to use), and what each is titled is what a store records."""

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
