"""Packed token arrays and prefix-shared prompts: exact round trips, linear storage, migration, spills."""

from __future__ import annotations

import random
import sqlite3
import time

import openai
import orjson
import pytest
import sqlite_utils
from openai._models import FinalRequestOptions
from openai.types.chat import ChatCompletion
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.capture import CapturedCall, Server
from lightning_rl.diagnostics import counters
from lightning_rl.records import PackedTokens, SpanRow, pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from lightning_rl.store import wire
from lightning_rl.store.ops import EncodedSpan, TracedSpan
from lightning_rl.store.rows import span_record_values
from lightning_rl.store.training_samples import trajectory_samples
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.store.tokens import MIN_SHARED_TOKENS
from lightning_rl.tracer import current_rollout

from .helpers import llm_span, old_schema_store, rollout, store_with_a_lost_base


def test_packing_keeps_every_value_exactly():
    ids = [0, 1, 151_000, 2**31 - 1]
    assert unpack_ids(pack_ids(ids)) == ids
    engine = [-0.5, -1.25, -3.0517578125e-05]  # float32 values, as vLLM computes them
    assert pack_logprobs(engine)[:1] == b"f" and unpack_logprobs(pack_logprobs(engine)) == engine
    other = [-0.1, -0.123456789012345]  # not float32: kept as float64, never rounded
    assert pack_logprobs(other)[:1] == b"d" and unpack_logprobs(pack_logprobs(other)) == other
    with pytest.raises(OverflowError, match="int32"):
        pack_ids([2**31])
    with pytest.raises(TypeError, match="int32"):
        pack_ids([1, "2"])
    with pytest.raises(ValueError, match="b'f'/b'd'"):
        unpack_logprobs(b"x\x00\x00\x00\x00")


def _turns(n_turns: int, rng: random.Random, first: int = 60, response: int = 12, observation: int = 20):
    prompt, turns = [rng.randrange(50_000) for _ in range(first)], []
    for _ in range(n_turns):
        out = [rng.randrange(50_000) for _ in range(response)]
        turns.append((prompt, out, [-rng.random() for _ in out]))
        prompt = prompt + out + [rng.randrange(50_000) for _ in range(observation)]
    return turns


def _stored_prompt_bytes(path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT coalesce(sum(length(prompt_ids)), 0) FROM spans").fetchone()[0]
    finally:
        conn.close()


def test_growing_prompts_are_stored_as_tails_and_read_back_whole(tmp_path):
    rng = random.Random(3)
    solver, checker = _turns(8, rng), _turns(8, rng)  # two agents of one rollout, calls interleaved
    spans, seq = [], 0
    for (sp, so, sl), (cp, co, cl) in zip(solver, checker):
        spans.append(llm_span("r1", seq, seq, sp, so, logprobs=sl, agent="solver"))
        spans.append(llm_span("r1", seq + 1, seq + 1, cp, co, logprobs=cl, agent="checker"))
        seq += 2
    path = tmp_path / "runs.db"
    with SQLiteStore(path) as store:
        store.start_rollout(rollout("r1"))
        store.add_spans(spans)
        store.finish_rollout("r1", "succeeded", 1.0, None)
        store.flush()
        calls = lrl.trajectory(store, "r1").llm_calls
        assert [c.prompt_token_ids for c in calls] == [s.tokens.prompt_ids for s in spans]
        assert [c.response_token_ids for c in calls] == [s.tokens.response_ids for s in spans]
        assert [c.response_logprobs for c in calls] == [s.tokens.response_logprobs for s in spans]  # float64 kept
        assert store.spans("r1")[-1].tokens.prompt_ids == spans[-1].tokens.prompt_ids
    # each agent's first prompt in full, then only each turn's observation (the response is its base's)
    assert _stored_prompt_bytes(path) == 4 * (2 * 60 + 2 * 7 * 20)
    assert sum(4 * len(s.tokens.prompt_ids) for s in spans) > 4 * _stored_prompt_bytes(path)
    conn = sqlite3.connect(path)
    refs = conn.execute("SELECT seq, prompt_base_seq, prompt_shared FROM spans ORDER BY seq").fetchall()
    conn.close()
    assert refs[:2] == [(0, None, 0), (1, None, 0)]
    assert all(base == s - 2 for s, base, _ in refs[2:])  # each agent's own previous call, not the other's


def test_a_prompt_that_diverges_shares_its_common_prefix_only(tmp_path):
    rng = random.Random(5)
    first = [rng.randrange(50_000) for _ in range(100)]
    retokenized = first[:70] + [7, 7, 7]  # the history re-rendered differently from token 70 on
    short = first[:MIN_SHARED_TOKENS - 1] + [9]  # too little in common to refer to
    with SQLiteStore(tmp_path / "runs.db") as store:
        store.start_rollout(rollout("r1"))
        store.add_spans([llm_span("r1", 0, 0, first, [1, 2]), llm_span("r1", 1, 1, retokenized, [3]),
                         llm_span("r1", 2, 2, short, [4])])
        store.flush()
        assert [c.prompt_token_ids for c in lrl.trajectory(store, "r1").llm_calls] == [first, retokenized, short]
        rows = store._read("SELECT prompt_base_seq, prompt_shared, length(prompt_ids) FROM spans ORDER BY seq")
    assert rows == [(None, 0, 400), (0, 70, 12), (None, 0, 4 * MIN_SHARED_TOKENS)]


def test_a_reference_to_a_missing_span_reads_as_missing_tokens_not_wrong_ones(tmp_path):
    turns = _turns(3, random.Random(1))
    path = tmp_path / "runs.db"
    store_with_a_lost_base(path, [llm_span("r1", i, i, p, o, logprobs=lp) for i, (p, o, lp) in enumerate(turns)])
    before = counters().get("llm_calls_with_unresolved_prompt", 0)
    with SQLiteStore(path) as store:
        traj = lrl.trajectory(store, "r1")
        first, third = traj.llm_calls
        assert first.prompt_token_ids == turns[0][0] and first.token_ids_source == "engine"
        assert third.prompt_token_ids == [] and third.token_ids_source == "missing"
        samples, _ = trajectory_samples(traj)
        assert [s.llm_call_indices for s in samples] == [[0]]  # never trained on a prompt it cannot rebuild
    assert counters()["llm_calls_with_unresolved_prompt"] == before + 1


def test_a_schema_4_store_is_migrated_to_packed_prefix_shared_tokens(tmp_path):
    turns = _turns(5, random.Random(2))
    legacy = [{semconv.GEN_AI_OPERATION_NAME: "chat", semconv.LLM_CALL_INDEX: i, semconv.TOKEN_IDS_SOURCE: "engine",
               semconv.PROMPT_TOKEN_IDS: p, semconv.RESPONSE_TOKEN_IDS: o, semconv.RESPONSE_LOGPROBS: lp}
              for i, (p, o, lp) in enumerate(turns)]
    legacy.append({semconv.GEN_AI_OPERATION_NAME: "chat", semconv.LLM_CALL_INDEX: 5, semconv.TOKEN_IDS_SOURCE: "engine",
                   semconv.PROMPT_TOKEN_IDS: [2**40], semconv.RESPONSE_TOKEN_IDS: [1]})  # cannot pack: kept as is
    path = tmp_path / "old.db"
    old_schema_store(path, 4, legacy)
    with SQLiteStore(path) as store:
        calls = lrl.trajectory(store, "old").llm_calls
        assert [c.prompt_token_ids for c in calls[:5]] == [p for p, _, _ in turns]
        assert [c.response_logprobs for c in calls[:5]] == [lp for _, _, lp in turns]
        assert calls[5].prompt_token_ids == [2**40]  # still read from its attributes
        spans = store.spans("old")
        assert all(semconv.PROMPT_TOKEN_IDS not in s.attributes for s in spans[:5])
    db = sqlite_utils.Database(path)  # still one plain SQLite file for sqlite-utils and the CLI
    assert db["spans"].columns_dict["prompt_ids"] is bytes and db.execute("PRAGMA user_version").fetchone()[0] >= 5
    assert db.execute("SELECT count(*) FROM spans WHERE prompt_base_seq IS NOT NULL").fetchone()[0] == 4
    db.close()


def test_a_spill_file_is_written_back_with_its_tokens_and_a_line_of_no_known_op_is_quarantined(tmp_path):
    rng = random.Random(4)
    (p0, o0, l0), (p1, o1, l1) = _turns(2, rng)
    with SQLiteStore(tmp_path / "runs.db") as store:
        store.start_rollout(rollout("r1"))
    traced = SpanRow("r1", 0, 1, 1, None, "chat tiny", "CLIENT", 1, 2, "OK", None,
                     {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.LLM_CALL_INDEX: 0, semconv.TOKEN_IDS_SOURCE: "engine"},
                     (), PackedTokens.of(p0, o0, l0))
    ingested = llm_span("r1", 1, 1, p1, o1, logprobs=l1)
    unknown = orjson.dumps({"kind": "span_packed", "payload": ["r1", 2]})  # no op this version writes
    folder = tmp_path / "runs.db.spill"
    folder.mkdir(exist_ok=True)
    (folder / "0000000001-999999999.jsonl").write_bytes(  # left by a process that is gone
        wire.encode(TracedSpan(traced)) + b"\n" + wire.encode(EncodedSpan(span_record_values(ingested))) + b"\n"
        + unknown + b"\n")
    with SQLiteStore(tmp_path / "runs.db") as store:  # adopted on open and written back (it tries every second)
        deadline = time.monotonic() + 20
        while store.spill_files and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not store.spill_files
        calls = lrl.trajectory(store, "r1").llm_calls
        (note,) = store.quarantined()
    assert [(c.prompt_token_ids, c.response_token_ids, c.response_logprobs) for c in calls] == [(p0, o0, l0), (p1, o1, l1)]
    assert note.kind == "spill line" and "not an op this version writes" in note.reason and "span_packed" in note.payload


def _completion(prompt: list[int], response: list[int], logprobs: list[float]) -> ChatCompletion:
    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny", "prompt_token_ids": prompt,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(response), "total_tokens": 0},
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": response,
                     "message": {"role": "assistant", "content": "ok"},
                     "logprobs": {"content": [{"token": "x", "logprob": lp, "bytes": [120], "top_logprobs": []}
                                              for lp in logprobs]}}]})


@pytest.mark.parametrize("where", ["sqlite", "server"])
def test_the_tracer_hands_arrays_beside_otel_attributes_exactly(tmp_path, where):
    """The user's exporter sees the GenAI attributes and no token arrays; the store gets the arrays exactly,
    also through the store server's packed wire format."""
    exporter = InMemorySpanExporter()
    turns = _turns(4, random.Random(6))
    server = BackgroundServer(tmp_path / "served.db").__enter__() if where == "server" else None
    try:
        store = lrl.configure(store=server.url if server else f"sqlite:///{tmp_path / 'runs.db'}",
                              span_processors=[SimpleSpanProcessor(exporter)])
        client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="EMPTY")
        options = FinalRequestOptions(method="post", url="/chat/completions",
                                      json_data={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})

        @lrl.trace
        def agent() -> float:
            for prompt, response, logprobs in turns:
                CapturedCall(Server.from_url(client.base_url), options.json_data, "chat",
                             current_rollout()).record_response(_completion(prompt, response, logprobs))
            return 1.0

        agent()
        (traj,) = list(lrl.trajectories(store))
        assert [(c.prompt_token_ids, c.response_token_ids, c.response_logprobs) for c in traj.llm_calls] == turns
        llm_spans = [s for s in exporter.get_finished_spans() if s.name == "chat tiny"]
        assert len(llm_spans) == 4
        for span in llm_spans:
            assert span.attributes[semconv.TOKEN_IDS_SOURCE] == "engine"
            assert span.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] > 0 and span.attributes[semconv.GEN_AI_REQUEST_MODEL]
            assert not {semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS} & set(span.attributes)
    finally:
        lrl.configure(store="memory://")
        if server:
            server.__exit__(None, None, None)
