"""The writer's commit window (``store/writer.py``): spans of a running rollout wait a moment for company;
a rollout's end, a flush, a reward and an ingest never wait."""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import Rollout, RolloutStatus, SpanRow
from lightning_rl.store import SQLiteStore
from lightning_rl.store.durable import COMMIT_WINDOW
from lightning_rl.store.ops import TracedSpan
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


def _wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_after_a_windowed_batch_the_next_ops_are_written_within_a_window_and_an_idle_writer_waits_again():
    """The writer's stream (issue 57): after a batch its window closed on, it waits one window for the next ops
    instead of being woken by the first; after a wait that found nothing it sleeps, and an op that wakes it
    waits for company again."""
    writer, batches = _writer(window=0.3)
    try:
        first = _Patient()
        writer.put(first)
        assert _wait_for(lambda: len(batches) == 1)
        second = _Patient()  # put while the writer waits the window after its batch: written when it closes
        writer.put(second)
        assert _wait_for(lambda: len(batches) == 2)
        assert batches[1] == [second]
        time.sleep(0.8)  # the window after the second batch closes on nothing: the writer sleeps
        third, fourth = _Patient(), _Patient()
        writer.put(third)
        writer.put(fourth)  # the third woke the writer, which waits a window for company: both go together
        assert _wait_for(lambda: len(batches) == 3)
        assert batches[2] == [third, fourth]
    finally:
        writer.close()


def _voluntary_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split(":")[1])
    raise AssertionError("no voluntary_ctxt_switches line")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads a thread's context switches in /proc")
def test_after_a_flush_the_writer_sleeps_while_the_agent_runs():
    """Reproduces issue 57's idle writer: after a flush the writer slept 2 ms and then waited for the GIL while
    the agent's thread ran, and an agent that lets the GIL go for a moment (the openai client's os.urandom per
    request) woke it each time without it ever getting the GIL: hundreds of wake-ups, CPU of both threads,
    charged to untraced work. It must sleep until the next op instead."""
    writer, batches = _writer(window=0.05)
    try:
        writer.put(_Patient())
        assert writer.flush(10.0)
        native_id = writer._thread.native_id
        before = _voluntary_switches(native_id)
        until = time.monotonic() + 0.3
        while time.monotonic() < until:  # an agent's thread: Python work, and a moment without the GIL
            sum(range(2000))
            os.urandom(16)
        assert _voluntary_switches(native_id) - before <= 1
    finally:
        writer.close()


def _span_row(rollout_id: str, seq: int) -> SpanRow:
    return SpanRow(rollout_id, seq, 1, seq + 1, None, "execute_tool t", "INTERNAL", 1, 2, "UNSET", None,
                   {"gen_ai.operation.name": "execute_tool"}, ())


@pytest.mark.parametrize("limit, rows, inserts", [(None, 53, 1), (999, 100, 3)])
def test_a_running_rollouts_spans_go_in_one_statement_per_batch(tmp_path, limit, rows, inserts):
    """Python's sqlite3 lets the GIL go around every step of a statement, and the writer waits to take it back
    while the agent runs (issue 57): a batch of a running rollout's spans is one INSERT, its own transaction
    (none begun around it), and past the library's bound-parameter limit (999 before SQLite 3.32) one INSERT per
    chunk in one transaction. Every row is stored once (a statement's size is rounded up with copies of its last
    row, which INSERT OR IGNORE skips)."""
    store = SQLiteStore(tmp_path / "runs.db")
    try:
        store.start_rollout(Rollout(rollout_id="r1", name="agent", status=RolloutStatus.RUNNING, start_time=1.0))
        assert store.flush(10.0)
        if limit is not None:
            store._wconn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)
        statements: list[str] = []
        store._wconn.set_trace_callback(statements.append)
        writer = store._writer
        writer.put_many([TracedSpan(_span_row("r1", seq)) for seq in range(rows)])  # one batch
        assert store.flush(10.0)
        store._wconn.set_trace_callback(None)
        spans = [s for s in statements if s.startswith("INSERT OR IGNORE INTO spans")]
        assert len(spans) == inserts
        assert any(s.startswith("BEGIN") for s in statements) == (inserts > 1)
        with sqlite3.connect(tmp_path / "runs.db") as reader:
            assert reader.execute("SELECT count(*), count(DISTINCT seq) FROM spans WHERE rollout_id = 'r1'").fetchone() \
                == (rows, rows)
    finally:
        store.close()


def test_a_due_batch_the_writer_does_not_come_for_is_handed_over_and_a_stuck_writer_is_not_waited_on_again():
    """While the agent's thread runs Python the writer may not get the GIL at all (issue 57: its timer fires, and
    it loses the race for the GIL call after call), so a put that finds its buffer's window closed and the batch
    not taken waits for the writer to write it (letting the GIL go), one window at most; a writer that does not
    write in that time (a store that cannot be written) is not waited on again until it writes."""
    from lightning_rl import diagnostics

    gates = [threading.Event(), threading.Event()]
    entered = [threading.Event(), threading.Event()]
    batches: list[list] = []

    def apply(ops: list) -> None:
        stuck = len(batches) < 2 and not gates[len(batches)].is_set()
        if stuck:
            entered[len(batches)].set()
            gates[len(batches)].wait(30)
        batches.append(list(ops))

    def hand_overs() -> int:
        return diagnostics.counters().get("writer_hand_overs", 0) - before

    window = 0.2
    writer = BackgroundWriter(apply, window=window, may_wait=lambda op: type(op) is _Patient)
    before = diagnostics.counters().get("writer_hand_overs", 0)
    try:
        writer.put(_Patient())
        assert entered[0].wait(10)  # the first batch is being written, and stays stuck
        writer.put(_Patient())
        time.sleep(window + 0.05)  # the next buffer's window closes while the writer is stuck
        started = time.monotonic()
        writer.put(_Patient())  # hands over: waits one window for the stuck writer, then goes on
        assert window * 0.9 <= time.monotonic() - started < 5.0
        for _ in range(20):
            writer.put(_Patient())  # the writer has not written since: not waited on again
        assert hand_overs() == 1
        gates[0].set()  # the store writes again
        assert _wait_for(lambda: len(batches) >= 1)
        late = _Patient()
        assert _wait_for(lambda: entered[1].is_set())  # the second batch (the rest) is being written, slowly
        writer.put(late)
        time.sleep(window + 0.05)  # its window closes while the writer is busy
        threading.Timer(0.05, gates[1].set).start()  # the write ends within the hand-over's window
        writer.put(_Patient())
        assert hand_overs() == 2
        assert any(late in batch for batch in batches)  # written by the time the hand-over returned
    finally:
        for gate in gates:
            gate.set()
        writer.close()


def _writer_here(window: float, fail_here: list[bool] | None = None) -> tuple[BackgroundWriter, list[tuple]]:
    """A writer whose due windows may be written on the putting thread: batches as (thread name, ops)."""
    batches: list[tuple] = []

    def apply(ops: list) -> None:
        batches.append((threading.current_thread().name, list(ops)))

    def write_here(ops: list) -> None:
        if fail_here and fail_here.pop(0):
            raise sqlite3.OperationalError("database is locked")
        batches.append((threading.current_thread().name, list(ops)))

    return BackgroundWriter(apply, window=window, may_wait=lambda op: type(op) is _Patient,
                            write_here=write_here, name="the-writer"), batches


def _put_for(writer: BackgroundWriter, seconds: float) -> list:
    """An agent's thread: Python work, a moment without the GIL (os.urandom), a put, about every millisecond."""
    ops = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        sum(range(40_000))
        os.urandom(16)
        op = _Patient()
        ops.append(op)
        writer.put(op)
    return ops


def test_a_due_windows_batch_is_written_on_the_putting_thread_in_order_and_the_rest_by_the_writer():
    """Issue 57, "Writing here": a put that finds its window closed takes the batch and writes it itself; what is
    left when the puts stop is written by the writer within about a window; every op once, in order."""
    writer, batches = _writer_here(window=0.05)
    try:
        ops = _put_for(writer, 0.6)
        assert _wait_for(lambda: sum(len(b) for _, b in batches) == len(ops))
        written = [op for _, batch in batches for op in batch]
        assert written == ops  # once each, in the order put
        here = [name for name, _ in batches if name == threading.current_thread().name]
        assert len(here) >= 3, [(name, len(b)) for name, b in batches]  # ~12 windows, most written here
        # The puts' last op may itself have closed a window here (it came in the window's last 5 ms), so the
        # writer's part is shown with an op nobody puts after: only the writer can write it.
        last = _Patient()
        writer.put(last)
        assert _wait_for(lambda: batches[-1][1] == [last])
        assert batches[-1][0] == "the-writer"
    finally:
        writer.close()


def test_a_write_here_that_fails_goes_back_to_the_writer_first_and_is_not_tried_again_until_the_writer_writes():
    from lightning_rl import diagnostics

    before = diagnostics.counters().get("writes_here_given_back", 0)
    writer, batches = _writer_here(window=0.05, fail_here=[True] + [False] * 100)
    writer._early = 0.045  # (of 0.05) the putting thread takes each window's batch long before the writer
    try:
        ops = _put_for(writer, 0.4)
        assert writer.flush(10.0)
        assert diagnostics.counters().get("writes_here_given_back", 0) - before == 1
        written = [op for _, batch in batches for op in batch]
        assert written == ops  # nothing lost, nothing twice, the given-back batch before what came after it
        names = [name for name, _ in batches]
        assert names[0] == "the-writer"  # the batch that failed here, and what came meanwhile: the writer's
        assert threading.current_thread().name in names[1:]  # after the writer wrote, writes here again
    finally:
        writer.close()


def test_a_write_here_never_waits_for_a_locked_database_and_the_writer_writes_the_spans_later(tmp_path):
    """The agent's thread never waits on SQLite's lock (30 s by default): the write here fails at once, and the
    batch goes back to the writer, which waits for the lock as long as it may."""
    from lightning_rl import diagnostics

    store = SQLiteStore(tmp_path / "runs.db")
    blocker = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    try:
        store.start_rollout(Rollout(rollout_id="r1", name="agent", status=RolloutStatus.RUNNING, start_time=1.0))
        assert store.flush(10.0)
        before = diagnostics.counters().get("writes_here_given_back", 0)
        blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        writer = store._writer
        # A long window whose batch is the putting thread's to take 10 ms after it opens: the writer does not
        # come for it first however late a loaded machine wakes this thread from its sleep.
        writer._window = 5.0
        writer._early = writer._window - 0.01
        started = time.monotonic()
        writer.put(TracedSpan(_span_row("r1", 1)))
        writer.put(TracedSpan(_span_row("r1", 2)))
        time.sleep(0.015)  # the window is about to close
        writer.put(TracedSpan(_span_row("r1", 3)))  # writes here: locked, refused at once, given back
        assert diagnostics.counters().get("writes_here_given_back", 0) - before == 1
        for seq in range(4, 40):  # the writer waits for the lock with the batch: they queue
            writer.put(TracedSpan(_span_row("r1", seq)))
        assert time.monotonic() - started < 2.0  # no put waited for the lock
        blocker.execute("COMMIT")
        assert store.flush(30.0)
        with sqlite3.connect(tmp_path / "runs.db") as reader:
            assert reader.execute("SELECT count(*), min(seq), max(seq) FROM spans WHERE rollout_id = 'r1'").fetchone() \
                == (39, 1, 39)
    finally:
        blocker.close()
        store.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads a thread's context switches in /proc")
def test_a_writer_due_out_of_its_wait_is_let_in_instead_of_losing_the_gil_at_every_put():
    """Issue 57, "Letting in": with its window's batches written on the agent's thread, the writer still wakes
    on its timer, and then lost the race for the GIL at every moment the agent let it go (about once a put),
    a futex round trip on both threads each time. A put that finds it due out of its wait lets it in."""
    writer, batches = _writer_here(window=0.05)
    try:
        native_id = writer._thread.native_id
        before = _voluntary_switches(native_id)
        ops = _put_for(writer, 1.0)
        switches = _voluntary_switches(native_id) - before
        assert switches < len(ops) * 0.3, (switches, len(ops))  # a few a window, not one a put
        assert writer.flush(10.0)
        assert [op for _, batch in batches for op in batch] == ops
    finally:
        writer.close()


def test_a_let_in_is_the_normal_path_and_only_a_writer_not_out_within_a_window_is_counted():
    """lrl.stats() lists what went wrong or waited: a let-in that the writer comes out for is neither (a
    fresh-clone run failed test_mcp_session on {'writer_let_in': 1}); a writer that does not come out within
    the window it is given is counted, and not waited on again until it comes out."""
    from lightning_rl import diagnostics

    def writers() -> dict[str, int]:  # the writers' counters (this worker's other tests may count others)
        return {name: n for name, n in diagnostics.counters().items() if name.startswith("writer_")}

    key = "writer_let_ins_timed_out"
    writer, _ = _writer_here(window=0.3)
    before = writers()
    try:
        assert _wait_for(lambda: writer._sleeping)  # asleep until an op comes
        threading.Timer(0.01, writer.put, args=("finish",)).start()  # an op that wakes it, while this put waits
        with writer._lock:
            writer._let_in()
            assert writer._stuck_check_in != writer._check_ins  # it came out
        assert writers() == before  # nothing counted
        assert writer.flush(10.0) and _wait_for(lambda: writer._sleeping)  # asleep, and nothing comes
        with writer._lock:
            started = time.monotonic()
            writer._let_in()
            assert 0.29 <= time.monotonic() - started < 5.0  # one window, then the put goes on
            assert writer._stuck_check_in == writer._check_ins  # not again until the writer comes out
        after = writers()
        assert after.pop(key) - before.pop(key, 0) == 1 and after == before  # that, and nothing else
    finally:
        writer.close()


def test_threads_putting_at_once_write_each_window_once_each_op_once_in_each_threads_order():
    writer, batches = _writer_here(window=0.03)
    results: dict[str, list] = {}

    def agent() -> None:
        results[threading.current_thread().name] = _put_for(writer, 0.5)

    threads = [threading.Thread(target=agent, name=f"agent-{i}") for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert writer.flush(10.0)
        written = [op for _, batch in batches for op in batch]
        assert len(written) == len(set(map(id, written))) == sum(len(ops) for ops in results.values())
        position = {id(op): i for i, op in enumerate(written)}
        for ops in results.values():
            assert [position[id(op)] for op in ops] == sorted(position[id(op)] for op in ops)
        assert {name for name, _ in batches} & set(results)  # some windows written by the agents' threads
    finally:
        writer.close()


def test_an_interrupt_during_a_write_here_gives_the_batch_back_and_the_writer_writes_it():
    batches: list[list] = []
    interrupted = [False]

    def write_here(ops: list) -> None:
        if not interrupted[0]:
            interrupted[0] = True
            raise KeyboardInterrupt
        batches.append(list(ops))

    writer = BackgroundWriter(lambda ops: batches.append(list(ops)), window=0.05,
                              may_wait=lambda op: type(op) is _Patient, write_here=write_here)
    writer._early = 0.04
    try:
        ops = [_Patient(), _Patient()]
        for op in ops:
            writer.put(op)
        time.sleep(0.015)
        last = _Patient()
        with pytest.raises(KeyboardInterrupt):  # the user's Ctrl-C reaches the agent
            writer.put(last)
        assert writer.flush(10.0)  # the writer was not left waiting for the batch
        assert [op for batch in batches for op in batch] == [*ops, last]
    finally:
        writer.close()
