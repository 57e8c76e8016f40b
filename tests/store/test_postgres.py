"""What only the PostgreSQL store has to get right, against a real PostgreSQL server (the contract suite runs
it through everything every store does): its schema of its own, refusing what is not its own, text
PostgreSQL cannot hold, and records kept while the database is away."""

from __future__ import annotations

import os
import time

import psycopg
import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.errors import ConfigurationError, NotAStoreError, SchemaTooNewError, StoreError
from lightning_rl.records import Rollout, RolloutStatus
from lightning_rl.store.postgres.schema import latest_version
from lightning_rl.store.postgres.store import PostgresStore, parse_url
from tests.pg_cluster import PostgresCluster

from .helpers import llm_span, rollout


def _conninfo(url: str) -> str:
    return parse_url(url)[0]


def test_open_store_takes_a_postgresql_url_and_says_where_without_the_password(pg_url):
    with_password = pg_url.replace("://postgres@", "://postgres:s3cret@")
    with lrl.open_store(with_password) as store:
        assert isinstance(store, PostgresStore) and store.schema == "lightning_rl"
        assert "s3cret" not in store.shown and store.shown.startswith("postgresql://postgres@127.0.0.1:")
        with pytest.raises(lrl.RolloutNotFoundError) as info:
            store.get_rollout("nope")
        assert "s3cret" not in str(info.value)


@pytest.mark.parametrize("url, fix", [("postgresql://h/db?schema=Bad-Name", "lowercase"),
                                      ("postgresql://h:5432", "DATABASE")])
def test_a_bad_url_is_refused_naming_the_fix(url, fix):
    with pytest.raises(ConfigurationError, match=fix):
        parse_url(url)


def test_two_stores_share_a_database_in_schemas_of_their_own(pg_url):
    a, b = PostgresStore(pg_url), PostgresStore(pg_url + "?schema=team_b")
    try:
        a.start_rollout(rollout("only-in-a"))
        a.flush()
        assert [r.rollout_id for r in a.rollouts()] == ["only-in-a"] and b.rollouts() == []
    finally:
        a.close()
        b.close()
    with psycopg.connect(_conninfo(pg_url)) as conn:
        schemas = {r[0] for r in conn.execute("SELECT DISTINCT table_schema FROM information_schema.tables "
                                              "WHERE table_name = 'rollouts'")}
    assert schemas == {"lightning_rl", "team_b"}


def test_a_schema_with_tables_of_someone_else_is_refused_untouched(pg_url):
    with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
        conn.execute("CREATE SCHEMA lightning_rl")
        conn.execute("CREATE TABLE lightning_rl.invoices (id int)")
    with pytest.raises(NotAStoreError, match="invoices"):
        PostgresStore(pg_url)
    with psycopg.connect(_conninfo(pg_url)) as conn:
        tables = [r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables "
                                             "WHERE table_schema = 'lightning_rl'")]
    assert tables == ["invoices"]


def test_a_store_of_a_newer_lightning_rl_is_refused(pg_url):
    PostgresStore(pg_url).close()
    with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
        conn.execute("UPDATE lightning_rl._lightning_rl_store SET value = %s WHERE key = 'schema_version'",
                     (str(latest_version() + 1),))
    with pytest.raises(SchemaTooNewError, match="upgrade lightning-rl"):
        PostgresStore(pg_url)


def test_a_read_only_open_creates_nothing_and_writes_nothing(pg_url):
    with pytest.raises(StoreError, match="read-only open does not create"):
        PostgresStore(pg_url, read_only=True)
    with PostgresStore(pg_url) as store:
        store.start_rollout(rollout("r1"))
        store.flush()
    with PostgresStore(pg_url, read_only=True) as viewer:
        assert [r.rollout_id for r in viewer.rollouts()] == ["r1"]
        for call in (lambda: viewer.start_rollout(rollout("r2")), lambda: viewer.add_reward("r1", 1.0),
                     lambda: viewer.enqueue({"q": 1}), lambda: viewer.record_policy("p", 1)):
            with pytest.raises(StoreError, match="read-only"):
                call()


def test_text_postgresql_cannot_hold_is_kept_readable_and_counted(pg_url):
    diagnostics.reset()
    with PostgresStore(pg_url) as store:
        store.start_rollout(rollout("nul\x00id"))
        store.start_rollout(Rollout(rollout_id="r1", name="agent\x00name", task={"q": "a\x00b"}, start_time=time.time()))
        store.finish_rollout("r1", RolloutStatus.FAILED, time.time(), "boom\x00")
        store.add_spans([llm_span("r1", 0, 0, [1, 2], [3])])
        store.flush()
        got = store.get_rollout("r1")
        assert got.name == "agent\ufffdname" and got.error == "boom\ufffd" and got.task == {"q": "a\x00b"}
        assert got.status == RolloutStatus.FAILED and len(store.spans("r1")) == 1
        assert store.get_rollout("nul\ufffdid")
        assert store.quarantined() == []
    assert diagnostics.counters()["text_nul_replaced"] >= 2


def test_records_written_while_the_database_is_away_are_spilled_then_written_back_in_order(tmp_path, monkeypatch):
    """The database restarts under a running store: its writer retries, spills to a local file in order, and
    writes the backlog back when the database answers; reads wait it out (retry_for)."""
    monkeypatch.setenv("LIGHTNING_RL_SPILL_DIR", str(tmp_path / "spill"))
    cluster = PostgresCluster(os.path.join(os.path.dirname(__file__), "..", "..", ".cache",
                                           f"pg-spill-{os.getpid()}")).start()
    try:
        url = cluster.create_database()
        store = PostgresStore(url, give_up_after=0.5, retry_for=60.0)
        store.start_rollout(rollout("before"))
        assert store.flush(10)
        cluster.kill()
        store.start_rollout(rollout("during"))
        store.finish_rollout("during", RolloutStatus.SUCCEEDED, time.time(), None)
        assert store.flush(30)  # spilled: kept on disk, not lost
        assert store.spill_files, "nothing was spilled while the database was away"
        cluster.start()
        deadline = time.monotonic() + 60
        while store.spill_files and time.monotonic() < deadline:
            store.flush(5)
            time.sleep(0.2)
        assert not store.spill_files
        got = store.get_rollout("during")  # replayed in order: the finish after the start
        assert got.status == RolloutStatus.SUCCEEDED and store.get_rollout("before")
        store.close()
    finally:
        cluster.destroy()


@pytest.mark.parametrize("url, says", [
    ("postgresql://lrl:s3cret@127.0.0.1:5432", "not postgresql://USER@HOST:PORT/DATABASE"),
    ("postgresql://lrl:s3cret@127.0.0.1:99999/db", "Port out of range"),
    ("postgresql://lrl:s3cret@127.0.0.1:notaport/db", "could not be cast"),
    ("postgresql+psycopg://lrl:s3cret@127.0.0.1/db", "not supported"),
    ("http://127.0.0.1:8765,postgresql://lrl:s3cret@127.0.0.1/db", "not an http(s)://HOST:PORT"),
    ("postgresql:/lrl:s3cret@127.0.0.1/db", "one slash after postgresql:"),
    ("postgresql://lrl:s3cret@127.0.0.1:1/db?shcema=x", "invalid URI query parameter"),
])
def test_a_mistaken_url_is_one_clear_error_that_never_shows_the_password(url, says, tmp_path, monkeypatch):
    """A user trial's mistakes: each was a traceback, showed the password, or (one slash) made a SQLite file
    named after the URL."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as info:
        lrl.open_store(url).close()
    assert says in str(info.value) and "s3cret" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_a_missing_password_says_where_to_give_it(pg_cluster):
    """libpq's 'no password supplied' does not say where a password goes; the store's message does."""
    cluster_url = pg_cluster.url()
    with psycopg.connect(cluster_url, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS needs_password")
        conn.execute("CREATE ROLE needs_password LOGIN PASSWORD 'pw'")
    hba = pg_cluster.data / "pg_hba.conf"
    before = hba.read_text()
    try:
        hba.write_text("host all needs_password 127.0.0.1/32 scram-sha-256\n" + before)
        with psycopg.connect(cluster_url, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
        url = cluster_url.replace("postgres@", "needs_password@")
        with pytest.raises(StoreError, match="PGPASSWORD or ~/.pgpass"):
            PostgresStore(url)
    finally:
        hba.write_text(before)
        with psycopg.connect(cluster_url, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
