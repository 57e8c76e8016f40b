"""Message text stored once per rollout (issue 33): each call's input messages as a reference to an
earlier call's conversation plus what it added, read back as the very JSON text the tracer recorded,
through every reader (spans, trajectories, the chat export, the store server), from old stores too."""

from __future__ import annotations

import random
import sqlite3
import time

import httpx
import openai
import orjson

import lightning_rl as lrl
from lightning_rl.store.sqlite.migrations import latest_version
from lightning_rl import semconv
from lightning_rl.diagnostics import counters
from lightning_rl.records import Span
from lightning_rl.store.export import chat_examples
from lightning_rl.store import wire
from lightning_rl.store.ops import EncodedSpan
from lightning_rl.store.rows import span_record_values
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.store.sqlite.store import SQLiteStore

from .helpers import old_schema_store, rollout, store_with_a_lost_base

_IN, _OUT = semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES
_WORDS = ["alpha", "bravo", "delta", "kilo", "lima", "oscar", "tango", "victor", "zulu", "ünïcode", "引号\"q\""]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _conversation(turns: int, rng: random.Random, agent: str = "") -> list[tuple[list[dict], dict]]:
    """(input messages, answer) per turn of an agent loop: each input is the previous input + answer + a tool result."""
    messages, calls = [{"role": "system", "content": f"{agent} " + _text(rng, 60)}, {"role": "user", "content": _text(rng, 30)}], []
    for turn in range(turns):
        answer = {"role": "assistant", "content": _text(rng, 20),
                  "tool_calls": [{"id": f"c{turn}", "type": "function", "function": {"name": "look", "arguments": "{}"}}]}
        calls.append((list(messages), answer))
        messages = messages + [answer, {"role": "tool", "tool_call_id": f"c{turn}", "content": _text(rng, 80)}]
    return calls


def _span(rollout_id: str, seq: int, messages: list[dict], answer: dict, agent: str | None = None) -> Span:
    attrs = {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.LLM_CALL_INDEX: seq, _IN: orjson.dumps(messages).decode(),
             _OUT: orjson.dumps([answer]).decode()}
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return Span(rollout_id=rollout_id, seq=seq, trace_id="%032x" % 1, span_id="%016x" % (seq + 1), name="chat tiny",
                kind="CLIENT", start_ns=seq, end_ns=seq + 1, attributes=attrs)


def _interleaved(rollout_id: str, turns: int = 8) -> list[Span]:
    """Two agents of one rollout whose calls alternate, each with its own growing history."""
    rng = random.Random(7)
    solver, checker = _conversation(turns, rng, "solver"), _conversation(turns, rng, "checker")
    spans = []
    for i, ((sm, sa), (cm, ca)) in enumerate(zip(solver, checker)):
        spans += [_span(rollout_id, 2 * i, sm, sa, "solver"), _span(rollout_id, 2 * i + 1, cm, ca, "checker")]
    return spans


def _stored_text(path) -> tuple[int, int]:
    """(characters of input messages stored, rows that refer to an earlier one)."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT coalesce(sum(length(input_messages)), 0), count(input_base_seq) FROM spans").fetchone()
    finally:
        conn.close()


def test_a_growing_conversation_is_stored_once_and_read_back_exactly(tmp_path):
    spans = _interleaved("r1")
    path = tmp_path / "runs.db"
    with SQLiteStore(path) as store:
        store.start_rollout(rollout("r1"))
        store.add_spans(spans)
        store.finish_rollout("r1", "succeeded", 1.0, None)
        store.flush()
        read = store.spans("r1")
        calls = lrl.trajectory(store, "r1").llm_calls
    assert [s.attributes for s in read] == [s.attributes for s in spans]  # the very strings, every key
    assert [c.input_messages for c in calls] == [orjson.loads(s.attributes[_IN]) for s in spans]
    whole = sum(len(s.attributes[_IN]) for s in spans)
    last_two = len(spans[-1].attributes[_IN]) + len(spans[-2].attributes[_IN])
    stored, referring = _stored_text(path)
    assert referring == len(spans) - 2  # every call after each agent's first refers to its previous one
    assert stored < 0.2 * whole and stored < last_two  # linear: about one copy of each agent's history
    raw = sqlite3.connect(path).execute("SELECT attributes FROM spans").fetchall()
    assert not any(_IN in a or _OUT in a for (a,) in raw)  # not escaped a second time inside the attributes


def test_a_resent_history_that_differs_shares_only_what_is_the_same(tmp_path):
    rng = random.Random(3)
    (m0, a0), (m1, _) = _conversation(2, rng)
    changed = [dict(m1[0], content=m1[0]["content"][:40] + " edited")] + m1[1:]  # the system prompt rewritten
    short = [{"role": "user", "content": "x"}]
    spans = [_span("r1", 0, m0, a0), _span("r1", 1, changed, a0), _span("r1", 2, short, a0)]
    with SQLiteStore(tmp_path / "runs.db") as store:
        store.start_rollout(rollout("r1"))
        store.add_spans(spans)
        store.flush()
        assert [s.attributes for s in store.spans("r1")] == [s.attributes for s in spans]
        rows = store._read("SELECT input_base_seq, input_shared FROM spans ORDER BY seq")
    assert rows[0] == (None, None) and rows[2] == (None, None)
    assert rows[1][0] == 0 and 64 <= rows[1][1] < len(spans[1].attributes[_IN])


def test_a_reference_to_a_missing_span_reads_without_messages_and_is_counted(tmp_path):
    spans = [_span("r1", i, m, a) for i, (m, a) in enumerate(_conversation(3, random.Random(1)))]
    path = tmp_path / "runs.db"
    store_with_a_lost_base(path, spans)
    before = counters().get("llm_calls_with_unresolved_messages", 0)
    with SQLiteStore(path) as store:
        first, third = store.spans("r1")
        assert first.attributes == spans[0].attributes
        assert _IN not in third.attributes and third.attributes[_OUT] == spans[2].attributes[_OUT]
    assert counters()["llm_calls_with_unresolved_messages"] == before + 1


def test_a_store_written_before_is_migrated_and_reads_the_same(tmp_path):
    spans = _interleaved("old", 5)
    path = tmp_path / "old.db"
    old_schema_store(path, 9, [s.attributes for s in spans])
    before = sqlite3.connect(path).execute("SELECT sum(length(attributes)) FROM spans").fetchone()[0]
    with SQLiteStore(path) as store:
        assert [s.attributes for s in store.spans("old")] == [s.attributes for s in spans]
        assert [c.input_messages for c in lrl.trajectory(store, "old").llm_calls] == [orjson.loads(s.attributes[_IN]) for s in spans]
    conn = sqlite3.connect(path)
    after = conn.execute("SELECT sum(length(attributes)) + sum(length(input_messages)) + sum(length(output_messages)) "
                         "FROM spans").fetchone()[0]
    assert conn.execute("SELECT count(input_base_seq) FROM spans").fetchone()[0] == len(spans) - 2
    assert after < before / 2
    conn.close()


def test_store_migrate_says_what_it_did_and_gives_the_freed_space_back(tmp_path, caplog):
    from click.testing import CliRunner

    from lightning_rl.cli import main

    old_schema_store(tmp_path / "old.db", 9, [s.attributes for s in _interleaved("old", 12)])
    path = tmp_path / "old.db"
    with caplog.at_level("WARNING", logger="lightning_rl"):
        done = CliRunner().invoke(main, ["store", "migrate", "--store", str(path), "--vacuum"])
    assert done.exit_code == 0, done.output
    assert f"upgraded from schema 9 to {latest_version()}" in done.output
    before, after = (int(x.replace(",", "")) for x in done.output.split("vacuumed, ")[1].split(" bytes")[0].split(" -> "))
    assert after < before and path.stat().st_size == after
    assert any("upgraded the store" in r.getMessage() and f"from schema 9 to {latest_version()}" in r.getMessage() for r in caplog.records)
    again = CliRunner().invoke(main, ["store", "migrate", "--store", str(path)])
    assert again.exit_code == 0 and f"schema {latest_version()}, up to date" in again.output
    with SQLiteStore(path) as store:
        assert len(lrl.trajectory(store, "old").llm_calls) == 24


def test_a_spilled_span_is_written_back_with_its_messages_shared(tmp_path):
    """A spill line carries a span as the wire does (messages inside its attributes); written back, the
    messages go to their columns, a later call's input refers to the earlier one, and reads give them whole."""
    spans = _interleaved("r1", 3)
    with SQLiteStore(tmp_path / "runs.db") as store:
        store.start_rollout(rollout("r1"))
    folder = tmp_path / "runs.db.spill"
    folder.mkdir(exist_ok=True)
    (folder / "0000000001-999999999.jsonl").write_bytes(
        b"".join(wire.encode(EncodedSpan(span_record_values(s))) + b"\n" for s in spans))
    with SQLiteStore(tmp_path / "runs.db") as store:
        deadline = time.monotonic() + 20
        while store.spill_files and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not store.spill_files
        assert [s.attributes for s in store.spans("r1")] == [s.attributes for s in spans]
    assert _stored_text(tmp_path / "runs.db")[1] == len(spans) - 2  # shared, as when written directly


def test_the_store_server_shares_and_its_readers_get_whole_conversations(tmp_path):
    spans = _interleaved("r1", 6)
    with BackgroundServer(tmp_path / "served.db") as server:
        store = lrl.open_store(server.url)
        try:
            store.start_rollout(rollout("r1"))
            store.add_spans(spans)
            store.finish_rollout("r1", "succeeded", 1.0, None)
            store.flush()
            assert [s.attributes for s in store.spans("r1")] == [s.attributes for s in spans]
            assert [c.input_messages for c in lrl.trajectory(store, "r1").llm_calls] == \
                [orjson.loads(s.attributes[_IN]) for s in spans]
        finally:
            store.close()
    assert _stored_text(tmp_path / "served.db")[1] == len(spans) - 2


def _vllm_handler(request: httpx.Request) -> httpx.Response:
    body = orjson.loads(request.content)
    n = len(orjson.dumps(body["messages"])) // 4  # about 4 characters a token
    return httpx.Response(200, json={
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
        "prompt_token_ids": list(range(n)),
        "usage": {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2},
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [n, n + 1],
                     "message": {"role": "assistant", "content": f"step {len(body['messages'])} " + "word " * 30},
                     "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}] * 2}}]})


def test_an_agent_loop_through_the_openai_client_stores_its_history_once(tmp_path):
    """The public path: a traced agent, the openai client, the SQLite store; the chat export reads whole."""
    path = tmp_path / "runs.db"
    store = lrl.configure(store=f"sqlite:///{path}")
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="EMPTY",
                           http_client=httpx.Client(transport=httpx.MockTransport(_vllm_handler)))
    rng = random.Random(4)
    sent = []

    @lrl.trace
    def agent(task: str) -> float:
        messages = [{"role": "system", "content": _text(rng, 50)}, {"role": "user", "content": task}]
        for _ in range(12):
            sent.append(list(messages))
            answer = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
            messages += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": _text(rng, 40)}]
        return 1.0

    try:
        agent("count the words")
        (traj,) = list(lrl.trajectories(store))
        assert [c.input_messages for c in traj.llm_calls] == sent
        (example,), _ = chat_examples(store)
        assert example["messages"][:len(sent[-1])] == sent[-1]
        stored, referring = _stored_text(path)
        assert referring == len(sent) - 1 and stored < 2 * len(orjson.dumps(sent[-1]))
    finally:
        lrl.configure(store="memory://")


def test_the_gateways_records_share_their_history_too(traced):
    """An agent in another language, through the gateway: its growing conversation is stored once as well."""
    from lightning_rl.gateway import BackgroundGateway
    from lightning_rl.serving import ServerThread
    from tests.gateway.test_upstreams import fake_engine

    engine = ServerThread(fake_engine("a", []), name="fake-engine")
    engine.start("a fake engine")
    rng = random.Random(9)
    sent = []
    try:
        with BackgroundGateway([engine.url]) as gw:
            opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "chat"}).json()
            messages = [{"role": "system", "content": _text(rng, 50)}]
            for _ in range(6):
                messages.append({"role": "user", "content": _text(rng, 30)})
                sent.append(list(messages))
                r = httpx.post(opened["base_url"] + "/chat/completions", timeout=10,
                               json={"model": "m", "messages": messages})
                assert r.status_code == 200, r.text
                messages.append(r.json()["choices"][0]["message"])
            httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={})
    finally:
        engine.stop()
    calls = lrl.trajectory(traced, opened["rollout_id"]).llm_calls
    assert [c.input_messages for c in calls] == sent
    stored, referring = _stored_text(traced.path)
    assert referring == len(sent) - 1 and stored < 2 * len(orjson.dumps(sent[-1]))
