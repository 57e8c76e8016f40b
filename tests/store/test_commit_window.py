"""The writer's commit window (``store/writer.py``): spans of a running rollout wait a moment for company;
a rollout's end, a flush, a reward and an ingest never wait."""

from __future__ import annotations

import sqlite3
import threading
import time

import lightning_rl as lrl
from lightning_rl.store import SQLiteStore
from lightning_rl.store.durable import COMMIT_WINDOW
from lightning_rl.store.writer import BackgroundWriter


class _Patient:
    """An op the writer may hold back (as a running rollout's span)."""


def _writer(window: float) -> tuple[BackgroundWriter, list[list]]:
    batches: list[list] = []
    lock = threading.Lock()

    def apply(ops: list) -> None:
        with lock:
            batches.append(list(ops))

    return BackgroundWriter(apply, window=window, may_wait=lambda op: type(op) is _Patient), batches


def test_spans_of_a_running_rollout_wait_for_company_and_an_urgent_op_takes_them_at_once():
    writer, batches = _writer(window=30.0)
    try:
        patient = [_Patient() for _ in range(5)]
        for op in patient:
            writer.put(op)
        time.sleep(0.3)
        assert batches == []  # within the window: still waiting for company
        writer.put("finish")  # not a span: written at once, with everything queued before it
        deadline = time.monotonic() + 5
        while not batches and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batches == [[*patient, "finish"]]
    finally:
        writer.close()


def test_a_flush_does_not_wait_for_the_window():
    writer, batches = _writer(window=30.0)
    try:
        op = _Patient()
        writer.put(op)
        started = time.monotonic()
        assert writer.flush(5.0)
        assert time.monotonic() - started < 5.0
        assert batches == [[op]]
    finally:
        writer.close()


def test_a_span_alone_is_written_when_its_window_closes_without_a_flush():
    writer, batches = _writer(window=0.05)
    try:
        op = _Patient()
        writer.put(op)
        deadline = time.monotonic() + 10
        while not batches and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batches == [[op]]
    finally:
        writer.close()


def test_closing_writes_what_waits():
    writer, batches = _writer(window=30.0)
    ops = [_Patient() for _ in range(3)]
    for op in ops:
        writer.put(op)
    writer.close(10.0)
    assert [op for batch in batches for op in batch] == ops


def test_an_ingest_batch_is_written_at_once():
    writer, batches = _writer(window=30.0)
    try:
        ops = [_Patient() for _ in range(3)]
        writer.put_many(ops)
        deadline = time.monotonic() + 5
        while not batches and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batches == [ops]
    finally:
        writer.close()


def test_a_running_rollouts_spans_reach_the_file_on_their_own_and_a_finished_one_is_there_on_return(tmp_path):
    """Through the public API: another reader sees a running rollout's spans without any flush (the window
    closes), and the whole rollout as soon as the traced call returns."""
    path = tmp_path / "runs.db"
    store = SQLiteStore(path)
    lrl.configure(store=store)
    reader = sqlite3.connect(path)
    seen_while_running: list[int] = []

    def spans() -> int:
        return reader.execute("SELECT count(*) FROM spans").fetchone()[0]

    @lrl.trace
    def agent(task):
        for i in range(3):
            with lrl.tool_span("step", arguments={"i": i}) as tool:
                tool.result = str(i)
        deadline = time.monotonic() + 10 + COMMIT_WINDOW
        while spans() < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen_while_running.append(spans())
        with lrl.tool_span("last", arguments={}) as tool:
            tool.result = "done"
        return 1.0

    try:
        agent({"q": 1})
        assert seen_while_running == [3]
        # on disk when the call returned: the rollout's row says it finished, with every span
        assert reader.execute("SELECT status FROM rollouts").fetchall() == [("succeeded",)]
        assert spans() == 5  # the four tool spans and the rollout's own
    finally:
        reader.close()
        store.close()
