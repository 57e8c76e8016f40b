"""Issue 30's findings, each reproduced through the real servers on 127.0.0.1 (the store server, the
gateway, the viewer) or the public Python API, then shown fixed: a value that crosses a trust boundary
is answered 4xx naming the field and the limit, or set aside in the store's quarantine; ordinary writes
from other clients land after it, without waiting out a wedged store's retries; nothing recorded before is lost; reads never fail for
everyone because of one rollout."""

from __future__ import annotations

import gzip
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.boundaries import MAX_JSON_DEPTH
from lightning_rl.records import Rollout, RolloutStatus
from lightning_rl.serving import ServerThread
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.store.sqlite.store import SQLiteStore
from lightning_rl.tracer import tracing

from .services import NOT_WEDGED_S, wait_healthy
from .store.helpers import llm_span

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402

TOKEN = "s3cret-token"
BIG = 2**63
DEAD_ENGINE = "http://127.0.0.1:9"


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def _start(rid: str, **fields) -> dict:
    return {"op": "start_rollout", "rollout": {**Rollout(rollout_id=rid, task={"q": 1}).model_dump(mode="json"), **fields}}


def _span(rid: str, seq: int, **fields) -> dict:
    """A span op as a client sends it; ``fields`` replace the span's own (any value, as on the wire)."""
    span = llm_span(rid, 0, 0, [1, 2, 3], [4, 5]).model_dump(mode="json")
    span.update(seq=seq, **fields)
    return {"op": "span", "span": span}


def _count(db: Path, table: str, where: str = "1") -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(f"SELECT count(*) FROM {table} WHERE {where}").fetchone()[0]
    finally:
        conn.close()


def _lands(post, db: Path, rid: str) -> None:
    """An ordinary client's write, sent after the bad one, answered and in the file, not after a wedge's retries."""
    t0 = time.monotonic()
    resp = post({"ops": [_start(rid), _span(rid, 0)]})
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - t0 < NOT_WEDGED_S
    assert _count(db, "spans", f"rollout_id = '{rid}'") == 1


# -- 1. one integer >= 2**63 --------------------------------------------------------------------------
@pytest.fixture
def served(tmp_path):
    db = tmp_path / "served.db"
    with BackgroundServer(db, token=TOKEN) as srv:
        client = httpx.Client(base_url=srv.url + "/v1", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert client.post("/batch", json={"ops": [_start("before"), _span("before", 0)]}).status_code == 200
        srv.db = db
        yield srv, client
        client.close()


@pytest.mark.parametrize("ops, field", [
    ([_start("bad"), _span("bad", BIG)], "span.seq"),
    ([_start("bad"), _span("bad", 1, start_ns=2**64 - 1, end_ns=2**64 - 1)], "span.start_ns"),
    ([_start("bad", attempt=BIG)], "rollout.attempt"),
    ([_start("bad", policy_version=BIG)], "rollout.policy_version"),
    ([{"op": "reward", "reward": {"rollout_id": "before", "value": 1.0, "llm_call_index": BIG}}], "reward.llm_call_index"),
    ([{"op": "finish_rollout", "rollout_id": "before", "status": "succeeded", "end_time": 1.0, "policy_version": BIG}],
     "policy_version"),
    ([_start("bad", task={"n": 2**70})], "rollout.task"),
    ([_start("bad", task=_nested(MAX_JSON_DEPTH + 5))], "rollout.task"),
    ([_start("bad"), _span("bad", 1, attributes={"n": 2**64})], "span.attributes"),
    ([_start("bad"), _span("bad", 1, attributes={"deep": _nested(MAX_JSON_DEPTH + 5)})], "span.attributes"),
    ([_start("bad"), _span("bad", 1, events=[{"name": "e", "time_ns": 2**64}])], "span.events"),
    ([_start("bad"), _span("bad", 1, attributes={semconv.GEN_AI_OPERATION_NAME: ["chat"]})],
     semconv.GEN_AI_OPERATION_NAME),
])
def test_the_store_server_refuses_values_sqlite_cannot_hold_and_keeps_writing(served, ops, field):
    srv, client = served
    resp = client.post("/batch", content=_dumps_big({"ops": ops}), timeout=30)
    assert resp.status_code == 422, resp.text
    assert field in resp.text
    _lands(lambda body: client.post("/batch", json=body), srv.db, "after")
    assert _count(srv.db, "spans", "rollout_id = 'before'") == 1  # nothing recorded before is lost
    assert _count(srv.db, "rollouts", "rollout_id = 'bad'") == 0


def _dumps_big(value) -> bytes:
    """orjson cannot write integers beyond 64 bits; the stdlib can (an attacker's client)."""
    import json

    return json.dumps(value).encode()


def test_the_store_server_refuses_big_integers_anywhere_a_client_can_put_them(served):
    srv, client = served
    big_task = _dumps_big({"ops": [_start("bad", task={"n": 2**70})]})
    assert client.post("/batch", content=big_task, timeout=30).status_code == 422
    late = client.post("/rewards", json={"rollout_id": "before", "value": 1.0, "llm_call_index": BIG}, timeout=30)
    assert late.status_code == 422 and "llm_call_index" in late.text
    for path, params in (("/rewards", {"after": 2**64}), ("/rewards", {"limit": 2**64}),
                         ("/rollouts", {"limit": 2**64}), ("/rollouts", {"min_policy_version": 2**64})):
        resp = client.get(path, params=params, timeout=30)
        assert resp.status_code == 422, (path, params, resp.status_code, resp.text)
    page = client.post("/rollouts/page", json={"offset": 2**64}, timeout=30)
    assert page.status_code == 422
    enqueue = client.post("/queue/enqueue", json={"task": _nested(MAX_JSON_DEPTH + 5)}, timeout=30)
    assert enqueue.status_code == 422 and "task" in enqueue.text
    _lands(lambda body: client.post("/batch", json=body), srv.db, "after")


# -- 4. a task nested beyond what the encoder writes, through @trace ---------------------------------------
def test_a_task_too_deep_or_too_big_is_recorded_in_a_safe_form_and_never_raised(traced):
    @lrl.trace
    def agent(task):
        return 1.0

    assert agent(_nested(300)) == 1.0  # before: TypeError: Recursion limit reached, into the agent
    assert agent({"n": 2**70}) == 1.0

    @lrl.trace
    def fine(task):
        return 0.5

    t0 = time.monotonic()
    assert fine("ordinary") == 0.5
    assert time.monotonic() - t0 < NOT_WEDGED_S
    rollouts = {r.name: r for r in traced.rollouts()}
    deep, big = [r for r in traced.rollouts() if r.name == "agent"]
    assert isinstance(deep.task, str) and deep.task.startswith("[[[[") and len(deep.task) <= 1100
    assert big.task == {"n": str(2**70)}
    assert rollouts["fine"].status == RolloutStatus.SUCCEEDED
    assert [t.final_reward for t in lrl.trajectories(traced)] == [1.0, 1.0, 0.5]
    assert lrl.stats()["task_values_made_storable"] == 2


def test_rollout_overrides_and_store_calls_refuse_out_of_range_integers(traced):
    with pytest.raises(lrl.ConfigurationError, match="attempt"):
        with lrl.rollout_overrides(attempt=BIG):
            pass
    assert traced.rollouts() == []

    @lrl.trace
    def agent(task):
        return 1.0

    agent("x")
    rid = traced.rollouts()[0].rollout_id
    with pytest.raises(lrl.ConfigurationError, match="llm_call_index"):
        traced.add_reward(rid, 1.0, llm_call_index=BIG)
    with pytest.raises(lrl.ConfigurationError, match="task"):
        traced.enqueue(_nested(MAX_JSON_DEPTH + 5))
    assert [r.value for r in traced.rewards(rid)] == [1.0]


# -- 1 (the tracer path). a span whose own clock is beyond 64 bits --------------------------------------
def test_a_record_sqlite_cannot_bind_is_quarantined_and_the_rest_is_written(traced):
    @lrl.trace
    def agent(task):
        span = tracing.tracer.start_span("odd", start_time=2**64 - 1)
        span.end(end_time=2**64 - 1)
        with lrl.tool_span("calculator", call_id="c1") as t:
            t.result = "4"
        return 1.0

    t0 = time.monotonic()
    assert agent("x") == 1.0
    assert time.monotonic() - t0 < NOT_WEDGED_S  # before: the writer retried 30 s, then spilled this and all after it
    rid = traced.rollouts()[0].rollout_id
    (traj,) = lrl.trajectories(traced)
    assert traj.status == RolloutStatus.SUCCEEDED and traj.final_reward == 1.0
    assert [s.name for s in traj.tool_spans] == ["execute_tool calculator"]
    (q,) = traced.quarantined()
    assert q.kind == "span" and q.rollout_id == rid and "start_ns" in q.reason and "64-bit" in q.reason
    assert lrl.stats()["records_quarantined"] == 1
    assert traced.spill_files == []


# -- 2. OTLP gzip bombs, before any credential ----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def gateway_process(tmp_path):
    """``lightning-rl gateway`` as users start it, with a token, over a SQLite file."""
    port = _free_port()
    db = tmp_path / "gw.db"
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "gateway", "--upstream", DEAD_ENGINE,
                             "--store", str(db), "--port", str(port), "--token", TOKEN],
                            stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, what="the gateway")
    yield url, proc, db
    proc.terminate()
    proc.wait(30)


def test_a_gzip_bomb_is_refused_before_it_is_inflated(gateway_process):
    url, proc, _ = gateway_process
    bomb = gzip.compress(b"\0" * (256 * 2**20), compresslevel=9)
    assert len(bomb) < 300_000
    before = _peak_rss_mb(proc.pid)
    headers = {"content-type": "application/x-protobuf", "content-encoding": "gzip"}
    anonymous = httpx.post(url + "/v1/traces", content=bomb, headers=headers, timeout=30)
    assert anonymous.status_code == 401, anonymous.text  # before: 400, after inflating 256 MB
    admin = httpx.post(url + "/v1/traces", content=bomb, timeout=30,
                       headers={**headers, "authorization": f"Bearer {TOKEN}"})
    assert admin.status_code == 413 and "decompressed" in admin.text
    assert _peak_rss_mb(proc.pid) - before < 64  # before: +508 MB
    assert httpx.get(url + "/v1/health").status_code == 200


# -- 1, 3 and 5 through the gateway -------------------------------------------------------------------------
def refusing_engine():
    """An engine that refuses every chat request (as vLLM refuses a malformed one) and counts them."""
    app = FastAPI()
    app.state.hits = 0

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        app.state.hits += 1
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"message": "bad request"}}, status_code=400)

    return app


@pytest.fixture
def gateway(traced):
    from lightning_rl.gateway import BackgroundGateway

    engine = refusing_engine()
    thread = ServerThread(engine, name="refusing-engine")
    thread.start("a refusing engine")
    with BackgroundGateway([thread.url], token=TOKEN) as gw:
        gw.engine = engine
        yield gw
    thread.stop()


def _open(gw, **body) -> dict:
    resp = httpx.post(gw.url + "/v1/rollouts", json=body, headers={"authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _otlp_json(span_id: str, *, start: int = 1, end: int = 2, attributes: list | None = None) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"spans": [{
        "traceId": "0" * 31 + "1", "spanId": span_id, "name": "step", "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end), "attributes": attributes or []}]}]}]}


def _finish_lands(gw, store) -> None:
    other = _open(gw, task="other")
    t0 = time.monotonic()
    done = httpx.post(f"{gw.url}/v1/rollouts/{other['rollout_id']}/finish", json={"reward": 1.0},
                      headers={"authorization": f"Bearer {other['api_key']}"}, timeout=30)
    assert done.status_code == 200, done.text
    assert time.monotonic() - t0 < NOT_WEDGED_S
    assert store.get_rollout(other["rollout_id"]).status == RolloutStatus.SUCCEEDED
    assert store.spill_files == []


def test_one_rollout_key_cannot_wedge_the_store_through_the_gateway(gateway, traced):
    opened = _open(gateway, task="mine")
    key = {"authorization": f"Bearer {opened['api_key']}"}
    late = _otlp_json("00000000000000aa", start=2**64 - 1, end=2**64 - 1)
    resp = httpx.post(gateway.url + "/v1/traces", json=late, headers=key, timeout=30)
    assert resp.status_code == 400 and "startTimeUnixNano" in resp.text, resp.text
    array_op = _otlp_json("00000000000000ab", attributes=[
        {"key": semconv.GEN_AI_OPERATION_NAME, "value": {"arrayValue": {"values": [{"stringValue": "chat"}]}}}])
    resp = httpx.post(gateway.url + "/v1/traces", json=array_op, headers=key, timeout=30)
    assert resp.status_code == 400 and semconv.GEN_AI_OPERATION_NAME in resp.text, resp.text
    big_attempt = httpx.post(gateway.url + "/v1/rollouts", json={"task": 1, "attempt": BIG},
                             headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert big_attempt.status_code == 422 and "attempt" in big_attempt.text
    deep_task = httpx.post(gateway.url + "/v1/rollouts", json={"task": _nested(MAX_JSON_DEPTH + 5)},
                           headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert deep_task.status_code == 422 and "task" in deep_task.text
    _finish_lands(gateway, traced)


@pytest.mark.parametrize("messages, problem", [
    (["hello"], "messages[0]"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": "calculator"}]}],
     "messages[0].tool_calls[0].function"),
    ([{"role": "user", "content": _nested(300)}], "nested"),
])
def test_a_chat_request_the_assembly_cannot_read_is_refused_before_the_engine(gateway, traced, messages, problem):
    opened = _open(gateway, task="shapes")
    resp = httpx.post(opened["base_url"] + "/chat/completions", json={"model": "m", "messages": messages},
                      headers={"authorization": f"Bearer {opened['api_key']}"}, timeout=10)
    assert resp.status_code == 400, resp.text  # before: forwarded and recorded (or 500 when too deep)
    assert problem in resp.json()["error"]["message"]
    assert gateway.engine.state.hits == 0
    httpx.post(f"{gateway.url}/v1/rollouts/{opened['rollout_id']}/finish", json={},
               headers={"authorization": f"Bearer {opened['api_key']}"})
    list(lrl.trajectories(traced))
    lrl.samples(traced)


def test_credentials_are_checked_the_same_whether_or_not_the_rollout_exists(gateway, traced):
    known = _open(gateway, task="k")
    httpx.post(f"{gateway.url}/v1/rollouts/{known['rollout_id']}/finish", json={},
               headers={"authorization": f"Bearer {known['api_key']}"})
    for rid in (known["rollout_id"], "f" * 32):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer tök€n".encode()}):
            for route in ("rewards", "finish"):
                resp = httpx.post(f"{gateway.url}/v1/rollouts/{rid}/{route}", json={"value": 1.0}, headers=headers)
                assert resp.status_code == 401, (rid, headers, route, resp.status_code, resp.text)


def test_a_non_ascii_token_is_a_401_and_the_openapi_document_needs_the_token(gateway):
    for path, method in (("/v1/rollouts", "POST"), ("/v1/traces", "POST"), ("/v1/chat/completions", "POST"),
                         ("/openapi.json", "GET")):
        resp = httpx.request(method, gateway.url + path, json={}, headers={"authorization": "Bearer tök€n".encode()})
        assert resp.status_code == 401, (path, resp.status_code, resp.text)  # before: 500 (str compare_digest)
    assert httpx.get(gateway.url + "/openapi.json").status_code == 401
    doc = httpx.get(gateway.url + "/openapi.json", headers={"authorization": f"Bearer {TOKEN}"})
    assert doc.status_code == 200 and "/v1/rollouts" in doc.json()["paths"]
    assert httpx.get(gateway.url + "/v1/health").status_code == 200


# -- 3. one stored rollout must not break reads for everyone -------------------------------------------
def _plant(db: Path, rid: str, attributes: dict) -> None:
    """A span as a file written by another version (or an older gateway) may hold it, put straight in."""
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT INTO rollouts (rollout_id, name, task, attempt, mode, status, start_time, end_time) "
                     "VALUES (?, 'agent', '\"t\"', 0, 'train', 'succeeded', 1.0, 2.0)", (rid,))
        conn.execute("INSERT INTO spans (rollout_id, seq, trace_id, span_id, name, kind, start_ns, end_ns, status_code, "
                     "attributes) VALUES (?, 0, ?, ?, 'chat', 'CLIENT', 1, 2, 'UNSET', ?)",
                     (rid, "0" * 32, "0" * 16, orjson.dumps(attributes).decode()))
        conn.execute("INSERT INTO rewards (rollout_id, name, value, source, time, uid) "
                     "VALUES (?, 'reward', 1.0, 'returned', 2.0, ?)", (rid, rid))
    conn.close()


MALFORMED = [
    {semconv.GEN_AI_OPERATION_NAME: ["chat"]},
    {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_INPUT_MESSAGES: '["hello"]'},
    {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_OUTPUT_MESSAGES:
     '[{"role": "assistant", "tool_calls": [{"id": "c", "function": "calculator"}]}]'},
    {semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_OUTPUT_MESSAGES: '[{"role": "assistant", "tool_calls": "x"}]',
     semconv.LLM_CALL_INDEX: "first", semconv.POLICY_VERSION: [1], semconv.SAMPLING_PARAMS: "[1]",
     semconv.GEN_AI_RESPONSE_FINISH_REASONS: 7, semconv.GEN_AI_AGENT_NAME: {"a": 1}, semconv.TOKEN_IDS_SOURCE: "alien"},
]


def test_reads_skip_what_they_cannot_read_instead_of_failing_for_everyone(tmp_path):
    db = tmp_path / "mixed.db"
    good = SQLiteStore(db)

    @lrl.trace
    def agent(task):
        return 1.0

    lrl.configure(store=good)
    agent("good")
    good.flush()
    for i, attributes in enumerate(MALFORMED):
        _plant(db, f"bad{i}", attributes)
    trajectories = list(lrl.trajectories(good))  # before: TypeError: unhashable type: 'list' (or pydantic errors)
    assert len(trajectories) == 1 + len(MALFORMED)
    samples, _ = lrl.samples(good, include_unrewarded=True)
    out = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "export", "--store", str(db), "--format", "chat",
                          "--include-unrewarded"], capture_output=True, text=True)
    assert "Traceback" not in out.stderr, out.stderr
    from lightning_rl.viewer.app import BackgroundViewer

    with BackgroundViewer(good) as viewer:
        for i in range(len(MALFORMED)):
            page = httpx.get(f"{viewer.url}/rollouts/bad{i}")
            assert page.status_code == 200, page.text[-2000:]
    assert lrl.stats().get("malformed_span_fields", 0) + lrl.stats().get("malformed_spans_skipped", 0) > 0
    good.close()


# -- 5. the viewer --------------------------------------------------------------------------------------
def test_the_viewer_sends_safety_headers_and_keeps_no_raw_token(tmp_path):
    from lightning_rl.viewer.app import BackgroundViewer

    store = SQLiteStore(tmp_path / "v.db")
    with BackgroundViewer(store, token="s3cret") as viewer:
        assert httpx.get(viewer.url + "/", headers={"authorization": "Bearer tök€n".encode()}).status_code == 401
        assert httpx.get(viewer.url + "/", params={"token": "tök€n"}).status_code == 401
        opened = httpx.get(viewer.url + "/", params={"token": "s3cret"})
        cookie = opened.cookies.get("lrl_view_token") or next(
            (r.cookies.get("lrl_view_token") for r in opened.history if r.cookies.get("lrl_view_token")), None)
        assert cookie and "s3cret" not in cookie
        assert opened.status_code == 303 and opened.headers["location"] == "/"  # the token leaves the URL
        with httpx.Client(base_url=viewer.url, cookies={"lrl_view_token": cookie}) as browser:
            page = browser.get("/")
            assert page.status_code == 200
            assert "s3cret" not in page.text  # no raw token in links either
            assert browser.get("/", params={"page": str(2**64)}).status_code == 422  # before: 500
        headers = page.headers
        assert "default-src 'none'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
        assert httpx.get(viewer.url + "/", cookies={"lrl_view_token": "s3cret"}).status_code == 401  # the raw token is no session
    store.close()


def test_the_viewer_opens_a_store_read_only(tmp_path):
    """A spill file left by a dead writer stays where it is: the viewer never adopts, replays or migrates."""
    db = tmp_path / "ro.db"
    SQLiteStore(db).close()
    folder = Path(str(db) + ".spill")
    folder.mkdir()
    line = orjson.dumps({"kind": "rollout", "payload": list(_rollout_values("spilled"))})
    spill = folder / f"{time.time_ns():020d}-999999999.jsonl"  # a pid that is not running
    spill.write_bytes(line + b"\n")
    before = db.read_bytes()
    store = lrl.open_store(str(db), read_only=True)
    from lightning_rl.viewer.app import BackgroundViewer

    with BackgroundViewer(store) as viewer:
        assert httpx.get(viewer.url + "/").status_code == 200
    store.close()
    assert spill.exists() and db.read_bytes() == before
    with pytest.raises(lrl.StoreError, match="read-only"):
        store.add_reward("x", 1.0)


def _rollout_values(rid: str) -> tuple:
    from lightning_rl.store.rows import rollout_values

    return rollout_values(Rollout(rollout_id=rid))


# -- 5. slow headers ------------------------------------------------------------------------------------
def test_connections_that_never_finish_their_headers_are_closed(tmp_path):
    from lightning_rl.viewer.app import create_app

    store = SQLiteStore(tmp_path / "slow.db")
    thread = ServerThread(create_app(store), name="slow-headers", header_timeout=0.5)
    thread.start("the viewer")
    socks = []
    try:
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", thread.port))
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(s)
        time.sleep(1.5)
        closed = 0
        for s in socks:
            s.settimeout(2)
            try:
                closed += s.recv(1024) == b""
            except (socket.timeout, ConnectionResetError):
                closed += isinstance(sys.exc_info()[1], ConnectionResetError)
        assert closed == len(socks)  # before: all 50 held open
        assert httpx.get(thread.url + "/health").status_code == 200
    finally:
        for s in socks:
            s.close()
        thread.stop()
        store.close()
