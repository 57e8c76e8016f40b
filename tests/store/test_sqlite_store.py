"""What only the SQLite store does: WAL, migrations, refusing foreign files, many processes, no drops."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import sqlite3
import threading
import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import RolloutStatus, SpanRow
from lightning_rl.store import SQLiteStore, open_store
from lightning_rl.store.sqlite.migrations import APPLICATION_ID, latest_version

from .helpers import rollout


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_wal_mode_and_recorded_migrations(sqlite_store):
    conn = sqlite3.connect(sqlite_store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == latest_version()
    rows = conn.execute("SELECT version, name FROM _lightning_rl_migrations").fetchall()
    assert [r[0] for r in rows] == list(range(1, latest_version() + 1))


def test_reopen_is_idempotent_and_keeps_data(tmp_path):
    path = tmp_path / "runs.db"
    with SQLiteStore(path) as s:
        s.start_rollout(rollout("r1"))
    with SQLiteStore(path) as s:
        assert s.get_rollout("r1").rollout_id == "r1"


def test_refuses_foreign_sqlite_file_without_touching_it(tmp_path):
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER)")
    conn.commit()
    conn.close()
    before = _digest(path)
    with pytest.raises(lrl.NotAStoreError, match="did not create.*users.*new file"):
        SQLiteStore(path)
    assert _digest(path) == before


def test_refuses_non_sqlite_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a database at all" * 10)
    with pytest.raises(lrl.NotAStoreError, match="not a SQLite database"):
        open_store(f"sqlite:///{path}")
    assert path.read_text().startswith("hello")


def test_refuses_newer_schema_and_keeps_data(tmp_path):
    path = tmp_path / "runs.db"
    with SQLiteStore(path) as s:
        s.start_rollout(rollout("r1"))
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {latest_version() + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(lrl.SchemaTooNewError, match="newer.*upgrade lightning-rl"):
        SQLiteStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT rollout_id FROM rollouts").fetchall() == [("r1",)]


@pytest.mark.parametrize("url,message", [("sqlite://runs.db", "three slashes"), ("redis://x", "not supported"),
                                         (":memory:", "memory://")])
def test_bad_store_urls(url, message):
    with pytest.raises(lrl.ConfigurationError, match=message):
        open_store(url)


def _row(rid: str, seq: int) -> SpanRow:
    return SpanRow(rid, seq, 1, seq + 1, None, "s", "INTERNAL", 0, 1, "UNSET", None, {"i": seq}, ())


def test_backpressure_blocks_instead_of_dropping(tmp_path):
    s = SQLiteStore(tmp_path / "runs.db", queue_size=4)
    s.start_rollout(rollout("r1"))
    for seq in range(2000):
        s.write_span(_row("r1", seq))
    assert s.flush(30)
    assert len(s.spans("r1")) == 2000
    assert lrl.stats().get("writer_backpressure_waits", 0) > 0
    s.close()


def test_unwritable_store_spills_and_replays_without_duplicates(tmp_path):
    path = tmp_path / "runs.db"
    s = SQLiteStore(path, busy_timeout=0.05, give_up_after=0.3)
    s.start_rollout(rollout("r1"))
    assert s.flush(5)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    for seq in range(50):
        s.write_span(_row("r1", seq))
    assert s.flush(30)  # the batch was spilled, not dropped
    spilled = list((tmp_path / "runs.db.spill").glob("*.jsonl"))
    assert spilled
    blocker.execute("ROLLBACK")
    blocker.close()
    s.close()
    with SQLiteStore(path) as again:  # replayed on open
        assert [sp.seq for sp in again.spans("r1")] == list(range(50))
        assert not list((tmp_path / "runs.db.spill").glob("*.jsonl"))


def test_a_spill_keeps_order_and_is_written_back_while_the_store_is_open(tmp_path):
    # The start of a rollout is spilled (the file is locked); its reward and finish come after the
    # lock is gone. They must not overtake the start, and nobody has to reopen the store.
    path = tmp_path / "runs.db"
    rejected = lrl.stats().get("rejected_status_transitions", 0)
    s = SQLiteStore(path, busy_timeout=0.05, give_up_after=0.3)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    s.start_rollout(rollout("r1"))
    assert s.flush(10) and s.spill_files
    blocker.execute("ROLLBACK")
    blocker.close()
    s.write_reward(lrl.Reward(rollout_id="r1", value=1.0))
    s.finish_rollout("r1", RolloutStatus.SUCCEEDED, 2.0, None)
    assert s.flush(10)
    deadline = time.monotonic() + 10
    while s.spill_files and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not s.spill_files
    assert s.get_rollout("r1").status == RolloutStatus.SUCCEEDED
    assert [r.value for r in s.rewards("r1")] == [1.0]
    assert lrl.stats().get("rejected_status_transitions", 0) == rejected  # the finish found its rollout
    s.close()


def test_synchronous_is_normal_by_default_and_full_on_request(tmp_path, monkeypatch):
    with SQLiteStore(tmp_path / "a.db") as normal:
        assert normal._wconn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    with SQLiteStore(tmp_path / "b.db", synchronous="full") as full:
        assert full._wconn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: an fsync per commit
    monkeypatch.setenv("LIGHTNING_RL_SQLITE_SYNCHRONOUS", "full")
    with SQLiteStore(tmp_path / "c.db") as from_env:
        assert from_env._wconn.execute("PRAGMA synchronous").fetchone()[0] == 2
    monkeypatch.setenv("LIGHTNING_RL_SQLITE_SYNCHRONOUS", "sometimes")
    with pytest.raises(lrl.ConfigurationError, match="LIGHTNING_RL_SQLITE_SYNCHRONOUS='sometimes'.*normal, full"):
        SQLiteStore(tmp_path / "d.db")


def test_a_store_on_a_network_filesystem_is_reported(tmp_path, monkeypatch):
    from lightning_rl.store.sqlite import connections

    mounts = tmp_path / "mounts"
    shared = tmp_path / "shared dir"
    shared.mkdir()
    mounts.write_text("/dev/vda / ext4 rw 0 0\n"
                      f"fileserver:/export {str(shared).replace(' ', chr(92) + '040')} nfs4 rw,relatime 0 0\n")
    assert connections.filesystem_type(shared / "runs.db", mounts) == "nfs4"
    assert connections.filesystem_type(tmp_path / "local.db", mounts) == "ext4"
    monkeypatch.setattr(connections, "MOUNTS", mounts)
    before = lrl.stats().get("sqlite_on_network_filesystem", 0)
    with SQLiteStore(shared / "runs.db") as s:  # it still works on one machine; it says why it should not be shared
        s.start_rollout(rollout("r1"))
    with SQLiteStore(tmp_path / "local.db"):
        pass
    assert lrl.stats()["sqlite_on_network_filesystem"] - before == 1


def _writer_process(path: str, worker: int, n: int) -> None:
    import lightning_rl as lrl_child

    lrl_child.configure(store=f"sqlite:///{path}")

    @lrl_child.trace
    def agent(i):
        lrl_child.emit_reward(0.5)
        return float(i["i"])

    for i in range(n):
        agent({"worker": worker, "i": i})


def test_several_processes_write_one_file(tmp_path):
    path = str(tmp_path / "shared.db")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(path, w, 40)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with SQLiteStore(path) as s:
        rollouts = s.rollouts()
        assert len(rollouts) == 120 and all(r.status == RolloutStatus.SUCCEEDED for r in rollouts)
        conn = sqlite3.connect(path)
        assert conn.execute("SELECT count(*) FROM rewards").fetchone()[0] == 240
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_file_created_between_the_checks_two_reads_is_still_ours(tmp_path):
    """CI saw this with three processes: one read application_id (0, file empty), another process
    then committed the new schema, and the first read the tables: tables without our id, refused."""
    from lightning_rl.store.sqlite.migrations import check_is_store, migrate

    path = str(tmp_path / "new.db")
    creator = sqlite3.connect(path, isolation_level=None)
    creator.execute("PRAGMA journal_mode = WAL")
    checker = sqlite3.connect(path, isolation_level=None)
    seen = []

    def migrate_between_reads(statement):
        seen.append(statement)
        if "sqlite_master" in statement and creator.execute("PRAGMA user_version").fetchone()[0] == 0:
            migrate(creator, path)  # the other process's migration commits between the two reads

    checker.set_trace_callback(migrate_between_reads)
    check_is_store(checker, path)  # raised NotAStoreError before the check read in one transaction
    assert any("application_id" in s for s in seen) and any("sqlite_master" in s for s in seen)
    checker.set_trace_callback(None)
    check_is_store(checker, path)  # and once migrated, the file is ours
    assert creator.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    checker.close()
    creator.close()


def test_threads_tracing_concurrently_lose_nothing(tmp_path):
    s = SQLiteStore(tmp_path / "runs.db", queue_size=16)
    previous = lrl.tracer.tracing._sink
    lrl.configure(store=s)
    try:
        @lrl.trace
        def agent(i):
            for _ in range(5):
                lrl.emit_reward(1.0)
            return 0.0

        threads = [threading.Thread(target=lambda k=k: [agent(k * 100 + j) for j in range(25)]) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(s.rollouts()) == 100
        assert sum(len(s.rewards(r.rollout_id)) for r in s.rollouts()) == 600
    finally:
        lrl.tracer.tracing.set_sink(previous)
        s.close()


def test_a_schema_2_file_is_upgraded_and_its_rewards_get_uids(tmp_path):
    import sqlite_utils

    from lightning_rl.store.sqlite.migrations import MIGRATIONS

    path = tmp_path / "v2.db"
    conn = sqlite3.connect(path, isolation_level=None)
    db = sqlite_utils.Database(conn)
    for version in (1, 2):
        MIGRATIONS.get(version)(db)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO rollouts (rollout_id, name, attempt, mode, status, start_time) "
                 "VALUES ('r1', 'a', 0, 'train', 'succeeded', 1.0)")
    conn.execute("INSERT INTO queue (queue_id, group_id, task, attempt, mode, status, runner, lease_expires, tries, "
                 "max_tries, created) VALUES ('q1', 'g1', '{}', 0, 'train', 'leased', 'r-a', 1e12, 1, 3, 1.0)")
    conn.executemany("INSERT INTO rewards (rollout_id, name, value, source, time) VALUES ('r1', ?, ?, 'emitted', 1.0)",
                     [("reward", 1.0), ("step", 0.5)])
    conn.close()
    with SQLiteStore(path) as store:
        uids = [r.uid for r in store.rewards("r1")]
        assert [r.value for r in store.rewards("r1")] == [1.0, 0.5] and len(set(uids)) == 2 and all(uids)
        again = store.add_reward("r1", 2.0, uid=uids[0])  # an existing uid: not stored twice
        assert again.uid == uids[0] and len(store.rewards("r1")) == 2
        (row,) = store.rollout_page(text="r1").rows  # migration 11 summed the old rewards; the repeat added none
        assert (row.reward, row.rewards) == (1.0, 1)
        (held,) = store.queue_entries(["g1"])  # a lease from before lease keys: read, and completed as before
        assert held.lease_key is None and store.complete("q1", "r-a", "succeeded")
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == latest_version() == 15
    conn.close()


def test_a_schema_6_file_is_upgraded_and_its_publishes_have_no_lineage(tmp_path):
    import sqlite_utils

    from lightning_rl.store.sqlite.migrations import MIGRATIONS

    path = tmp_path / "v6.db"
    conn = sqlite3.connect(path, isolation_level=None)
    db = sqlite_utils.Database(conn)
    for version in range(1, 7):  # the schema as it was before policy lineage
        MIGRATIONS.get(version)(db)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 6")
    conn.executemany("INSERT INTO policies (served_name, version, adapter, time) VALUES (?, ?, ?, ?)",
                     [("policy", 0, None, 1.0), ("policy", 1, "/adapters/v00001", 2.0)])
    assert "trained_on" not in {r[1] for r in conn.execute("PRAGMA table_info(policies)")}
    conn.close()
    with SQLiteStore(path) as store:
        assert [(p.version, p.adapter, p.trained_on) for p in store.policies()] == [
            (0, None, None), (1, "/adapters/v00001", None)]
        store.record_policy("policy", 2, time=3.0, trained_on=["g-2", "g-1"])
        assert store.latest_policies()["policy"].trained_on == ["g-2", "g-1"]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == latest_version() == 15
    columns = {r[1]: (r[2], r[3]) for r in conn.execute("PRAGMA table_info(policies)")}
    assert columns["trained_on"] == ("TEXT", 0)  # nullable text: a JSON list of group ids
    assert conn.execute("SELECT trained_on FROM policies ORDER BY publish_id").fetchall() == [
        (None,), (None,), ('["g-2","g-1"]',)]
    assert conn.execute("SELECT name FROM _lightning_rl_migrations WHERE version = 7").fetchone()[0].startswith(
        "policy lineage")
    conn.close()
    with SQLiteStore(path) as store:  # opened again: nothing to migrate, nothing lost
        assert [p.trained_on for p in store.policies()] == [None, None, ["g-2", "g-1"]]


def test_a_schema_7_file_gets_rollout_origins(tmp_path):
    """Migration 8 adds Rollout.origin and the start-time indexes; rows written before it read as origin None."""
    import sqlite_utils

    from lightning_rl.store.sqlite.migrations import MIGRATIONS

    path = tmp_path / "v7.db"
    conn = sqlite3.connect(path, isolation_level=None)
    db = sqlite_utils.Database(conn)
    for version in range(1, 8):
        MIGRATIONS.get(version)(db)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 7")
    conn.execute("INSERT INTO rollouts (rollout_id, name, attempt, mode, status, start_time) "
                 "VALUES ('r-old', 'a', 0, 'train', 'running', 1.0)")
    conn.close()
    with SQLiteStore(path) as store:
        store.start_rollout(rollout("r-new", origin="gateway"))
        assert store.flush(10)
        assert store.get_rollout("r-old").origin is None
        assert store.get_rollout("r-new").origin == "gateway"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == latest_version() == 15
    indexes = {r[1] for r in conn.execute("PRAGMA index_list(rollouts)")}
    assert {"rollouts_start", "rollouts_status_start"} <= indexes
    plan = " ".join(r[3] for r in conn.execute(
        "EXPLAIN QUERY PLAN SELECT rollout_id FROM rollouts ORDER BY start_time DESC LIMIT 50"))
    assert "rollouts_start" in plan and "TEMP B-TREE" not in plan, plan  # the newest first, without a sort
    conn.close()
