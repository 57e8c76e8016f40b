"""The SQLite writer tells the two failures apart: a file it cannot write (locked, full) spills and
replays in order; a record it cannot write (a value SQLite cannot bind, a payload from another
version) is set aside in the quarantine table with its reason and payload, and the rest of its batch
is written. A restart replays nothing that can never succeed. ``lightning-rl store doctor`` shows it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.records import Reward, Rollout, RolloutStatus, SpanRow
from lightning_rl.store import wire
from lightning_rl.store.ops import FinishRollout, StartRollout, TracedSpan
from lightning_rl.store.sqlite.store import SQLiteStore

from ..services import NOT_WEDGED_S
from .helpers import llm_span, rollout


def _row(rid: str, seq: int, *, start: int = 1, attributes: dict | None = None) -> SpanRow:
    return SpanRow(rid, seq, 1, seq + 1, None, "step", "INTERNAL", start, start + 1, "UNSET", None,
                   attributes or {"gen_ai.operation.name": "execute_tool"}, ())


def test_a_bad_record_in_a_batch_is_quarantined_and_the_rest_written(tmp_path):
    diagnostics.reset()
    store = SQLiteStore(tmp_path / "q.db")
    store.start_rollout(rollout("r1"))
    for seq in range(5):
        store.write_span(_row("r1", seq, start=2**63 if seq == 2 else 1))
    with pytest.raises(ValueError, match="llm_call_index"):  # the record type refuses it where it is made
        Reward(rollout_id="r1", value=1.0, llm_call_index=2**63)
    # what got past that (a record built unchecked, a file of another version) is quarantined when written
    store.write_reward(Reward(rollout_id="r1", value=1.0).model_copy(update={"llm_call_index": 2**63}))
    store.write_reward(Reward(rollout_id="r1", value=0.5, name="ok"))
    store.finish_rollout("r1", RolloutStatus.SUCCEEDED, time.time(), None)
    t0 = time.monotonic()
    assert store.flush(30)
    assert time.monotonic() - t0 < NOT_WEDGED_S  # before: retried for 30 s, then spilled, and everything after it too
    assert [s.seq for s in store.spans("r1")] == [0, 1, 3, 4]
    assert [r.name for r in store.rewards("r1")] == ["ok"]
    assert store.get_rollout("r1").status == RolloutStatus.SUCCEEDED
    quarantined = store.quarantined()
    assert sorted(q.kind for q in quarantined) == ["reward", "span"]
    span_q = next(q for q in quarantined if q.kind == "span")
    assert span_q.rollout_id == "r1" and "start_ns" in span_q.reason and str(2**63) in span_q.reason
    assert orjson.loads(span_q.payload)["span"]["seq"] == 2  # the original record (a spill line), to repair
    assert lrl.stats()["records_quarantined"] == 2
    assert store.spill_files == []
    store.close()
    again = SQLiteStore(tmp_path / "q.db")  # a restart brings nothing back
    assert again.spill_files == [] and len(again.quarantined()) == 2
    again.start_rollout(rollout("r2"))
    assert again.flush(5) and again.get_rollout("r2")
    again.close()


def test_a_prompt_is_never_stored_as_a_reference_to_a_quarantined_span(tmp_path):
    store = SQLiteStore(tmp_path / "ref.db")
    store.start_rollout(rollout("r"))
    prompt = list(range(100, 140))
    bad = llm_span("r", 0, 0, prompt, [7, 8], logprobs=[-0.1, -0.2])
    from lightning_rl.records import PackedTokens

    def as_row(span, start):
        t = span.tokens
        return SpanRow("r", span.seq, 1, span.seq + 1, None, "chat", "CLIENT", start, start + 1, "UNSET", None,
                       span.attributes, (), PackedTokens.of(t.prompt_ids, t.response_ids, t.response_logprobs))

    store.write_span(as_row(bad, 2**63))  # quarantined: the next prompt extends it but must not refer to it
    follow = llm_span("r", 1, 1, prompt + [7, 8, 9, 10], [11], logprobs=[-0.3])
    store.write_span(as_row(follow, 5))
    assert store.flush(5)
    (call,) = lrl.trajectory(store, "r").llm_calls
    assert call.prompt_token_ids == prompt + [7, 8, 9, 10]
    store.close()


def test_a_spill_holding_a_record_that_can_never_be_written_is_replayed_without_it(tmp_path):
    """A spill file (damaged, or holding a record no store can hold) never fails the replay for ever: the
    next open writes everything else and quarantines the rest, each line with its reason."""
    db = tmp_path / "old.db"
    SQLiteStore(db).close()
    folder = Path(str(db) + ".spill")
    folder.mkdir()
    good = Rollout(rollout_id="good")
    bad = orjson.loads(wire.encode(StartRollout(Rollout(rollout_id="bad"))))
    bad["rollout"]["attempt"] = 2**63
    lines = [
        wire.encode(StartRollout(good)),
        orjson.dumps(bad),
        wire.encode(TracedSpan(_row("good", 0))),
        orjson.dumps({"op": "teleport", "to": "mars"}),
        wire.encode(FinishRollout("good", RolloutStatus.SUCCEEDED, 2.0)),
    ]
    path = folder / f"{time.time_ns():020d}-999999999.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\nnot json at all\n")
    store = SQLiteStore(db)
    assert store.flush(5)
    deadline = time.monotonic() + 5
    while store.spill_files and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.spill_files == [] and not path.exists()
    assert store.get_rollout("good").status == RolloutStatus.SUCCEEDED and len(store.spans("good")) == 1
    assert [r.rollout_id for r in store.rollouts()] == ["good"]
    reasons = sorted(q.reason for q in store.quarantined())
    assert len(reasons) == 3 and any("attempt" in r for r in reasons) and any("teleport" in r for r in reasons)
    store.close()
    again = SQLiteStore(db)
    assert again.spill_files == [] and len(again.quarantined()) == 3
    again.close()


def test_a_locked_file_still_spills_and_replays_in_order(tmp_path):
    """The old path is kept for what it was built for: the file itself cannot be written."""
    db = tmp_path / "locked.db"
    store = SQLiteStore(db, busy_timeout=0.05, give_up_after=0.3)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    store.start_rollout(rollout("r"))
    store.write_span(_row("r", 0))
    store.write_span(_row("r", 1, start=2**65))  # not even JSON can write it: spilled as its description
    store.finish_rollout("r", RolloutStatus.SUCCEEDED, 2.0, None)
    assert store.flush(5)
    assert store.spill_files  # the file is locked: spilled, in order
    holder.execute("ROLLBACK")
    holder.close()
    deadline = time.monotonic() + 5
    while store.spill_files and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.spill_files == []
    assert store.get_rollout("r").status == RolloutStatus.SUCCEEDED and [s.seq for s in store.spans("r")] == [0]
    (q,) = store.quarantined()
    assert q.kind == "span" and "start_ns" in q.reason and str(2**65) in q.reason
    store.close()


def test_store_doctor_shows_the_quarantine(tmp_path):
    store = SQLiteStore(tmp_path / "doc.db")
    store.start_rollout(rollout("r1"))
    store.write_span(_row("r1", 0, start=2**63))
    store.flush(5)
    store.close()
    out = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "store", "doctor", "--store",
                          str(tmp_path / "doc.db"), "--json"], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr  # something needs attention
    report = json.loads(out.stdout)
    assert report["quarantined"] == 1 and report["spill_files"] == 0
    (entry,) = report["quarantine"]
    assert entry["kind"] == "span" and "start_ns" in entry["reason"]
    text = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "store", "doctor", "--store",
                           str(tmp_path / "doc.db")], capture_output=True, text=True)
    assert "1 record(s) quarantined" in text.stdout and "start_ns" in text.stdout
    clean = SQLiteStore(tmp_path / "clean.db")
    clean.close()
    ok = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "store", "doctor", "--store",
                         str(tmp_path / "clean.db")], capture_output=True, text=True)
    assert ok.returncode == 0 and "nothing quarantined" in ok.stdout


def test_the_memory_and_http_stores_quarantine_too(store):
    """The contract: a record a store cannot hold never stops the others, whichever store it is."""
    diagnostics.reset()
    store.start_rollout(rollout("r1"))
    store.write_span(_row("r1", 0, start=2**64 - 1))
    store.write_span(_row("r1", 1))
    store.finish_rollout("r1", RolloutStatus.SUCCEEDED, 2.0, None)
    assert store.flush(10)
    assert [s.seq for s in store.spans("r1")] == [1]
    assert store.get_rollout("r1").status == RolloutStatus.SUCCEEDED
    counters = lrl.stats()
    assert counters.get("records_quarantined", 0) + counters.get("rejected_ops", 0) == 1
