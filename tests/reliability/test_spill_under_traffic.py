"""A short lock in the middle of steady traffic (issue 31): the records spill as designed, and the spill
is written back while the process stays busy, in order, nothing doubled. Before, a process whose writer
never went idle for a second (steady flushes: a trainer reading what it wrote) never replayed it: every
later rollout spilled too and stayed invisible to the same open store until the process exited."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import RolloutStatus
from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.tracer import tracing

from .conftest import write_figures

pytestmark = pytest.mark.reliability


def test_a_spill_is_written_back_under_steady_traffic(tmp_path):
    db = tmp_path / "busy.db"
    store = SQLiteStore(db, busy_timeout=0.05, give_up_after=0.3)
    previous = tracing._sink
    lrl.configure(store=store)
    stop, writers_stop = threading.Event(), threading.Event()
    finished: list[str] = []
    lock = threading.Lock()

    @lrl.trace
    def agent(task):
        for i in range(3):
            with lrl.tool_span("step", call_id=f"{task}-{i}"):
                pass
        return 1.0

    def traced_traffic(k: int) -> None:
        i = 0
        while not writers_stop.is_set():
            task = f"w{k}-{i}"
            agent(task)
            with lock:
                finished.append(task)
            i += 1
            time.sleep(0.02)

    def flush_traffic() -> None:  # a reader of the same store: flushes, never idle
        while not stop.is_set():
            store.flush(5)
            store.rollouts(limit=5, newest_first=True)
            time.sleep(0.05)

    threads = [threading.Thread(target=traced_traffic, args=(k,)) for k in range(3)]
    threads.append(threading.Thread(target=flush_traffic))
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        before_lock = len(finished)
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another process holds the file for a few seconds
        time.sleep(3.0)
        assert store.spill_files  # spilled as designed
        writers_stop.set()  # from here on the store only gets flushes and reads: it never goes idle
        for t in threads[:3]:
            t.join(30)
        holder.execute("ROLLBACK")
        holder.close()
        lifted = time.monotonic()
        while store.spill_files and time.monotonic() - lifted < 10:
            time.sleep(0.05)
        drained = time.monotonic() - lifted
        assert store.spill_files == []  # written back while the flushes go on (before: never, until exit)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    store.flush(10)
    with lock:
        done = list(finished)
    by_task = {r.task: r for r in store.rollouts()}
    assert len(by_task) == len(store.rollouts())  # nothing doubled
    missing = [task for task in done if task not in by_task]
    assert missing == []
    conn = sqlite3.connect(db)
    try:
        duplicated = conn.execute("SELECT count(*) FROM (SELECT rollout_id, seq FROM spans GROUP BY 1, 2 "
                                  "HAVING count(*) > 1)").fetchone()[0]
    finally:
        conn.close()
    assert duplicated == 0
    for task in done:  # in order: the finish after the start and spans, every span there
        rollout = by_task[task]
        assert rollout.status == RolloutStatus.SUCCEEDED, (task, rollout.status)
        assert len(store.spans(rollout.rollout_id)) == 4  # the rollout's span and 3 tool spans
    write_figures("spill_under_traffic", {"rollouts": len(done), "finished_before_the_lock": before_lock,
                                          "backlog_written_back_s": round(drained, 2)})
    tracing.set_sink(previous)
    store.close()
