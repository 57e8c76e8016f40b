"""Hostile values at every trust boundary, fuzzed with hypothesis against live servers on 127.0.0.1:
integers beyond 64 bits, nesting deeper than the encoder writes, a wrong type at any level of a valid
request, and compressed bombs. After every case: the service answers, the data written before is
unchanged, and an ordinary write from another client lands within a second. After all of them, every
read (trajectories, samples, the viewer's pages) still works for everyone.

Unlike ``test_fuzz_server.py`` (each case known to be invalid: it must be refused whole), a mutated
request here may be valid; what is asserted is what must hold either way: never a 5xx, never a
wedge, never a read that fails for everyone."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import sqlite3
import time
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.boundaries import MAX_JSON_DEPTH
from lightning_rl.records import Rollout, RolloutStatus
from lightning_rl.serving import ServerThread
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.store.sqlite.store import SQLiteStore

from ..store.helpers import llm_span
from ..services import NOT_WEDGED_S
from .conftest import write_figures

pytestmark = pytest.mark.reliability
pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402

TOKEN = "fuzz-token"
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SEEN: dict[str, dict[int, int]] = {}
LANDED: dict[str, list[float]] = {"store": [], "gateway": []}  # seconds for the ordinary write after each case


def _record(kind: str, status: int) -> None:
    SEEN.setdefault(kind, {}).setdefault(status, 0)
    SEEN[kind][status] += 1


def _figures(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"n": len(ordered), "median": round(ordered[len(ordered) // 2], 4), "max": round(ordered[-1], 4)}


def _nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


big_ints = st.one_of(st.integers(min_value=2**63, max_value=2**80), st.integers(min_value=-(2**80), max_value=-(2**63) - 1))
deep = st.integers(min_value=MAX_JSON_DEPTH + 1, max_value=400).map(_nested)
plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
hostile = st.one_of(big_ints, deep, plain)


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every position in a JSON value (where a mutation may go)."""
    found = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            found += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _paths(v, prefix + (i,))
    return found


@st.composite
def mutated(draw, valid: dict) -> tuple[str, dict]:
    """``valid`` with one position (any level) replaced by a hostile value."""
    body = copy.deepcopy(valid)
    path = draw(st.sampled_from(_paths(body)[1:]))
    value = draw(hostile)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return ".".join(str(p) for p in path), body


def _dumps(value: object) -> bytes:
    return json.dumps(value).encode()  # the stdlib writes any integer and any depth (as an attacker's client)


# -- the store server ------------------------------------------------------------------------------------
def _start(rid: str) -> dict:
    return {"op": "start_rollout", "rollout": Rollout(rollout_id=rid, task={"q": [1, {"a": 2}]}).model_dump(mode="json")}


def _span(rid: str, seq: int) -> dict:
    return {"op": "span", "span": llm_span(rid, seq, seq, [1, 2, 3], [4, 5]).model_dump(mode="json")}


def _batch(rid: str) -> dict:
    return {"ops": [_start(rid), _span(rid, 0),
                    {"op": "reward", "reward": {"rollout_id": rid, "value": 1.0, "llm_call_index": 0}},
                    {"op": "finish_rollout", "rollout_id": rid, "status": "succeeded", "end_time": 2.0,
                     "policy_version": 1}]}


def _seed_digest(db) -> str:
    conn = sqlite3.connect(db)
    try:
        h = hashlib.sha256()
        for table in ("rollouts", "spans", "rewards"):
            for row in conn.execute(f"SELECT * FROM {table} WHERE rollout_id = 'seed' ORDER BY 1, 2"):
                h.update(repr(row).encode())
        return h.hexdigest()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def store_server(tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzzb") / "served.db"
    with BackgroundServer(db, token=TOKEN) as server:
        client = httpx.Client(base_url=server.url + "/v1", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert client.post("/batch", json=_batch("seed")).status_code == 200
        assert client.post("/batch", json=_batch("target")).status_code == 200  # late rewards go here
        server.db, server.seed = db, _seed_digest(db)
        yield server, client
        client.close()


def _ordinary_write_lands(server, client) -> None:
    rid = "ok-" + uuid.uuid4().hex[:12]
    t0 = time.monotonic()
    resp = client.post("/batch", json=_batch(rid))
    elapsed = time.monotonic() - t0
    LANDED["store"].append(elapsed)
    assert resp.status_code == 200, resp.text[:500]
    assert elapsed < NOT_WEDGED_S
    assert client.get(f"/rollouts/{rid}").json()["status"] == "succeeded"


def _after(server, client) -> None:
    assert client.get("/health").status_code == 200
    assert _seed_digest(server.db) == server.seed
    _ordinary_write_lands(server, client)


@SETTINGS
@given(case=mutated(_batch("fuzzed")))
def test_a_batch_with_a_hostile_value_anywhere_never_wedges_the_store(store_server, case):
    server, client = store_server
    where, body = case
    body_rid = uuid.uuid4().hex  # each case its own rollout, so a valid mutation does not collide
    text = _dumps(body).replace(b'"fuzzed"', f'"{body_rid}"'.encode())
    resp = client.post("/batch", content=text)
    _record("batch: " + where.split(".")[2] if where.count(".") >= 2 else "batch: " + where, resp.status_code)
    assert resp.status_code in (200, 400, 422), (where, resp.status_code, resp.text[:500])
    if resp.status_code != 200:
        assert resp.json()["error"]
    _after(server, client)


@pytest.mark.parametrize("route", ["/rewards", "/queue/enqueue", "/rollouts/page", "/policies", "/queue/lease"])
@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_every_write_route_refuses_hostile_values(store_server, route, data):
    server, client = store_server
    valid = {"/rewards": {"rollout_id": "target", "value": 0.5, "llm_call_index": 0, "name": "fz"},
             "/queue/enqueue": {"task": {"q": [1, 2]}, "n": 1, "mode": "eval"},
             "/rollouts/page": {"offset": 0, "limit": 5, "policy_version": 1},
             "/policies": {"served_name": "fz", "version": 1, "trained_on": ["g"]},
             "/queue/lease": {"runner": "fz", "limit": 1, "lease_seconds": 1.0}}[route]
    where, body = data.draw(mutated(valid))
    resp = client.post(route, content=_dumps(body))
    _record(f"{route}: {where}", resp.status_code)
    assert resp.status_code < 500, (route, where, resp.status_code, resp.text[:500])
    _after(server, client)


@pytest.mark.parametrize("param", [("/rewards", "after"), ("/rewards", "limit"), ("/rollouts", "limit"),
                                   ("/rollouts", "min_policy_version"), ("/quarantine", "limit")])
@settings(SETTINGS, max_examples=20)
@given(value=big_ints | st.integers(-5, -1) | st.text(max_size=6))
def test_query_integers_are_bounded(store_server, param, value):
    server, client = store_server
    resp = client.get(param[0], params={param[1]: str(value)})
    _record(f"query {param[0]}?{param[1]}", resp.status_code)
    assert resp.status_code in (200, 422), resp.text[:300]
    _after(server, client)


def test_reads_still_work_for_everyone_after_the_store_fuzz(store_server):
    server, client = store_server
    store = SQLiteStore(server.db, read_only=True)
    try:
        trajectories = list(lrl.trajectories(store))
        lrl.samples(store, include_unrewarded=True)
        assert len(trajectories) == len(store.rollouts()) > 100
        assert client.get("/rollouts/seed/trajectory").status_code == 200
    finally:
        store.close()
    write_figures("fuzz_boundaries_store", {"answers": {k: {str(c): n for c, n in sorted(v.items())}
                                                         for k, v in sorted(SEEN.items())},
                                            "ordinary_write_s": _figures(LANDED["store"])})


# -- the gateway -------------------------------------------------------------------------------------------
def fake_engine():
    """An engine answering every chat request in vLLM's format (ids included): what it is asked is recorded."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        return {"id": "chatcmpl-fz", "object": "chat.completion", "created": 0, "model": str(body.get("model")),
                "prompt_token_ids": [1, 2, 3],
                "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [7, 8], "logprobs": None,
                             "message": {"role": "assistant", "content": "ok"}}]}

    return app


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    import lightning_rl as lrl
    from lightning_rl.gateway import BackgroundGateway
    from lightning_rl.tracer import tracing

    db = tmp_path_factory.mktemp("fuzzgw") / "gw.db"
    store = SQLiteStore(db)
    previous = tracing._sink
    lrl.configure(store=store)
    engine = ServerThread(fake_engine(), name="fuzz-engine")
    engine.start("a fake engine")
    with BackgroundGateway([engine.url], token=TOKEN) as gw:
        gw.store = store
        admin = {"authorization": f"Bearer {TOKEN}"}
        gw.seed = httpx.post(gw.url + "/v1/rollouts", json={"task": "seed"}, headers=admin).json()
        _call(gw, gw.seed, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        yield gw
    engine.stop()
    tracing.set_sink(previous)
    store.close()


def _call(gw, opened: dict, body: dict) -> httpx.Response:
    return httpx.post(opened["base_url"] + "/chat/completions", content=_dumps(body), timeout=10,
                      headers={"authorization": f"Bearer {opened['api_key']}", "content-type": "application/json"})


def _gateway_lands(gw) -> None:
    admin = {"authorization": f"Bearer {TOKEN}"}
    t0 = time.monotonic()
    opened = httpx.post(gw.url + "/v1/rollouts", json={"task": "ordinary"}, headers=admin).json()
    done = httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0},
                      headers={"authorization": f"Bearer {opened['api_key']}"})
    elapsed = time.monotonic() - t0
    LANDED["gateway"].append(elapsed)
    assert done.status_code == 200 and elapsed < NOT_WEDGED_S, (done.status_code, elapsed)
    assert gw.store.get_rollout(opened["rollout_id"]).status == RolloutStatus.SUCCEEDED
    assert gw.store.spill_files == []
    assert httpx.get(gw.url + "/v1/health").status_code == 200


CHAT = {"model": "m", "max_tokens": 4, "messages": [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"e\": \"2+2\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "4"}],
    "tools": [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]}


@SETTINGS
@given(case=mutated(CHAT))
def test_chat_requests_with_a_hostile_value_anywhere(gateway, case):
    where, body = case
    opened = httpx.post(gateway.url + "/v1/rollouts", json={"task": where}, headers={"authorization": f"Bearer {TOKEN}"}).json()
    resp = _call(gateway, opened, body)
    _record("chat: " + where.split(".")[0], resp.status_code)
    assert resp.status_code in (200, 400, 422), (where, resp.status_code, resp.text[:500])
    httpx.post(f"{gateway.url}/v1/rollouts/{opened['rollout_id']}/finish", json={},
               headers={"authorization": f"Bearer {opened['api_key']}"})
    _gateway_lands(gateway)


OPEN = {"task": {"q": [1, {"a": "b"}]}, "attempt": 1, "mode": "eval", "agent": "fz", "group_id": "g1"}


@SETTINGS
@given(case=mutated(OPEN))
def test_rollout_opening_with_a_hostile_value_anywhere(gateway, case):
    where, body = case
    resp = httpx.post(gateway.url + "/v1/rollouts", content=_dumps(body),
                      headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    _record("open: " + where.split(".")[0], resp.status_code)
    assert resp.status_code in (200, 400, 422), (where, resp.status_code, resp.text[:500])
    if resp.status_code == 200:
        opened = resp.json()
        httpx.post(f"{gateway.url}/v1/rollouts/{opened['rollout_id']}/finish", json={},
                   headers={"authorization": f"Bearer {opened['api_key']}"})
    _gateway_lands(gateway)


def _otlp(span_id: str) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "fz"}}]},
                               "scopeSpans": [{"spans": [{
                                   "traceId": "0" * 31 + "1", "spanId": span_id, "name": "step",
                                   "startTimeUnixNano": "1", "endTimeUnixNano": "2",
                                   "attributes": [{"key": semconv.GEN_AI_TOOL_NAME, "value": {"stringValue": "calc"}},
                                                  {"key": "n", "value": {"intValue": "3"}}],
                                   "events": [{"timeUnixNano": "1", "name": "e"}]}]}]}]}


@SETTINGS
@given(case=mutated(_otlp("00000000000000aa")), compress=st.booleans())
def test_otlp_exports_with_a_hostile_value_anywhere(gateway, case, compress):
    where, body = case
    opened = httpx.post(gateway.url + "/v1/rollouts", json={"task": "otlp"}, headers={"authorization": f"Bearer {TOKEN}"}).json()
    content = _dumps(body)
    headers = {"authorization": f"Bearer {opened['api_key']}", "content-type": "application/json"}
    if compress:
        content, headers["content-encoding"] = gzip.compress(content), "gzip"
    resp = httpx.post(gateway.url + "/v1/traces", content=content, headers=headers, timeout=10)
    _record("otlp: " + where.rsplit(".", 1)[-1], resp.status_code)
    assert resp.status_code in (200, 400), (where, resp.status_code, resp.text[:500])
    httpx.post(f"{gateway.url}/v1/rollouts/{opened['rollout_id']}/finish", json={},
               headers={"authorization": f"Bearer {opened['api_key']}"})
    _gateway_lands(gateway)


@pytest.mark.parametrize("credentials", ["none", "wrong", "key", "admin"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@settings(SETTINGS, max_examples=2)
@given(size_mb=st.integers(min_value=17, max_value=96))
def test_compressed_bombs_are_refused(gateway, size_mb, credentials, encoding):
    import zlib

    raw = b"\0" * (size_mb * 2**20)
    bomb = gzip.compress(raw, 9) if encoding == "gzip" else zlib.compress(raw, 9)
    opened = httpx.post(gateway.url + "/v1/rollouts", json={"task": "bomb"}, headers={"authorization": f"Bearer {TOKEN}"}).json()
    auth = {"none": None, "wrong": "Bearer nope", "key": f"Bearer {opened['api_key']}", "admin": f"Bearer {TOKEN}"}[credentials]
    headers = {"content-type": "application/x-protobuf", "content-encoding": encoding, **({"authorization": auth} if auth else {})}
    resp = httpx.post(gateway.url + "/v1/traces", content=bomb, headers=headers, timeout=30)
    _record(f"bomb ({credentials})", resp.status_code)
    assert resp.status_code == (401 if credentials in ("none", "wrong") else 413), resp.text[:300]
    httpx.post(f"{gateway.url}/v1/rollouts/{opened['rollout_id']}/finish", json={},
               headers={"authorization": f"Bearer {opened['api_key']}"})
    _gateway_lands(gateway)


def test_reads_still_work_for_everyone_after_the_gateway_fuzz(gateway):
    from lightning_rl.viewer.app import BackgroundViewer

    store = gateway.store
    store.flush()
    trajectories = list(lrl.trajectories(store))
    lrl.samples(store, include_unrewarded=True)
    assert len(trajectories) > 100
    seed = lrl.trajectory(store, gateway.seed["rollout_id"])
    assert len(seed.llm_calls) == 1 and seed.llm_calls[0].response_token_ids == [7, 8]
    with BackgroundViewer(store) as viewer:
        for t in trajectories[::7]:
            assert httpx.get(f"{viewer.url}/rollouts/{t.rollout_id}").status_code == 200
    write_figures("fuzz_boundaries_gateway", {"answers": {k: {str(c): n for c, n in sorted(v.items())}
                                                           for k, v in sorted(SEEN.items()) if not k.startswith(("batch", "/", "query"))},
                                              "ordinary_write_s": _figures(LANDED["gateway"])})
