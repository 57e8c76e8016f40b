"""Bad input, fuzzed with hypothesis against a live server: every bad request gets a 4xx that says
what is wrong, the server stays up, and the stored data is unchanged.

Bad batches are made by breaking one thing in a valid batch (so each is known to be invalid):
a wrong type, bad token ids, a non-finite reward, an unknown rollout id, an unknown field, a
truncated body, an oversized body, a bad token. Arbitrary JSON is also thrown at every write route
of the OpenAPI document (then only "no 5xx, server up" can be asserted: some of it is valid).
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import sqlite3
import struct
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_rl.records import Rollout
from lightning_rl.store.http.server import BackgroundServer

from ..store.helpers import llm_span
from .conftest import write_figures

pytestmark = pytest.mark.reliability

TOKEN = "fuzz-token"
LIMIT = 256 * 1024
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SEEN: dict[str, dict[int, int]] = {}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    with BackgroundServer(db, token=TOKEN, max_body_bytes=LIMIT) as server:
        client = httpx.Client(base_url=server.url + "/v1", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        seed = {"ops": [_start("known"), _span("known", 0)]}
        assert client.post("/batch", json=seed).status_code == 200
        server.db = db
        yield server, client
        client.close()
    write_figures("fuzz", {k: {str(code): n for code, n in sorted(v.items())} for k, v in SEEN.items()})


def _start(rollout_id: str) -> dict:
    return {"op": "start_rollout", "rollout": Rollout(rollout_id=rollout_id).model_dump(mode="json")}


def _span(rollout_id: str, seq: int) -> dict:
    return {"op": "span", "span": llm_span(rollout_id, seq, seq, [1, 2, 3], [4, 5]).model_dump(mode="json")}


def _valid_batch() -> dict:
    return {"ops": [_start("fresh"), _span("fresh", 0), _span("known", 1),
                    {"op": "reward", "reward": {"rollout_id": "known", "value": 1.0}},
                    {"op": "finish_rollout", "rollout_id": "fresh", "status": "succeeded", "end_time": 2.0}]}


def _digest(db) -> str:
    conn = sqlite3.connect(db)
    try:
        h = hashlib.sha256()
        for table in ("rollouts", "spans", "rewards", "queue"):
            for row in conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2"):
                h.update(repr(row).encode())
        return h.hexdigest()
    finally:
        conn.close()


def _record(kind: str, status: int) -> None:
    SEEN.setdefault(kind, {}).setdefault(status, 0)
    SEEN[kind][status] += 1


def _assert_refused(live, kind: str, resp: httpx.Response, before: str, allowed: set[int]) -> None:
    server, client = live
    _record(kind, resp.status_code)
    assert resp.status_code in allowed, (kind, resp.status_code, resp.text[:500])
    body = resp.json()
    assert body["error"]  # says what is wrong
    assert client.get("/health").status_code == 200
    assert _digest(server.db) == before


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
not_int = json_values.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
not_str = json_values.filter(lambda v: not isinstance(v, str))
bad_token_id = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**31, max_value=2**62),
                         st.floats(allow_nan=False), st.text(max_size=5), st.none(), st.booleans())


@st.composite
def broken_batches(draw) -> tuple[str, bytes]:
    batch = _valid_batch()
    span = batch["ops"][1]["span"]
    kind = draw(st.sampled_from(["int_field", "str_field", "token_ids", "legacy_token_ids", "reward", "unknown_rollout",
                                 "unknown_field", "missing_field", "bad_op", "finish_status", "logprobs", "packed"]))
    if kind == "int_field":
        span[draw(st.sampled_from(["seq", "start_ns", "end_ns"]))] = draw(not_int)
    elif kind == "str_field":
        span[draw(st.sampled_from(["rollout_id", "trace_id", "span_id", "name"]))] = draw(not_str)
    elif kind == "token_ids":
        ids = draw(st.lists(st.integers(0, 1000), max_size=5))
        ids.insert(draw(st.integers(0, len(ids))), draw(bad_token_id))
        span["tokens"][draw(st.sampled_from(["prompt_ids", "response_ids"]))] = ids
    elif kind == "legacy_token_ids":  # token arrays as attributes, as clients before 0.2 send them
        key = draw(st.sampled_from(["lightning_rl.prompt_token_ids", "lightning_rl.response_token_ids"]))
        ids = draw(st.lists(st.integers(0, 1000), max_size=5))
        ids.insert(draw(st.integers(0, len(ids))), draw(bad_token_id))
        span["tokens"] = None
        span["attributes"][key] = ids
    elif kind == "packed":  # the packed form HttpStore sends, broken: bad lengths, negative ids, bad log-probs
        prompt, response, logprobs = struct.pack("<3i", 1, 2, 3), struct.pack("<2i", 4, 5), b"f" + struct.pack("<2f", -0.1, -0.2)
        broken = draw(st.sampled_from(["prompt", "response", "logprobs"]))
        value = draw(st.sampled_from([
            "short", "negative", "bad_type", "count", "positive", "nan", "not_base64"]))
        if value == "short":
            data = (prompt if broken != "logprobs" else logprobs)[:-1]
        elif value == "negative" and broken != "logprobs":
            data = struct.pack("<2i", 4, -draw(st.integers(1, 2**31)))
        elif value in ("positive", "nan") and broken == "logprobs":
            data = b"f" + struct.pack("<2f", -0.1, 0.5 if value == "positive" else float("nan"))
        elif value == "bad_type" and broken == "logprobs":
            data = b"x" + logprobs[1:]
        else:  # a count that does not match the response tokens
            broken, data = "logprobs", b"d" + struct.pack("<3d", -0.1, -0.2, -0.3)
        packed = {"prompt": prompt, "response": response, "logprobs": logprobs, broken: data}
        span["tokens"] = {k: base64.b64encode(v).decode() for k, v in packed.items()}
        if value == "not_base64":
            span["tokens"][broken] = "%%%not base64"
    elif kind == "reward":
        batch["ops"][3]["reward"]["value"] = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]) | not_int.filter(
            lambda v: not isinstance(v, float)))
    elif kind == "unknown_rollout":
        target = draw(st.sampled_from([1, 3, 4]))
        ghost = "ghost-" + draw(st.text("abcdef0123456789", min_size=1, max_size=8))
        if target == 1:
            span["rollout_id"] = ghost
        elif target == 3:
            batch["ops"][3]["reward"]["rollout_id"] = ghost
        else:
            batch["ops"][4]["rollout_id"] = ghost
    elif kind == "unknown_field":
        op = batch["ops"][draw(st.integers(0, 4))]
        op[draw(st.sampled_from(["extra", "Op", "spam"]))] = draw(json_values)
    elif kind == "missing_field":
        del span[draw(st.sampled_from(["rollout_id", "seq", "trace_id", "span_id", "name", "start_ns", "end_ns"]))]
    elif kind == "bad_op":
        batch["ops"][draw(st.integers(0, 4))]["op"] = draw(not_str | st.sampled_from(["delete", "SPAN", ""]))
    elif kind == "finish_status":
        batch["ops"][4]["status"] = draw(st.sampled_from(["running", "queued", "done", ""]) | not_str)
    else:
        span["tokens"]["response_logprobs"] = draw(
            st.lists(st.floats(min_value=0.001, max_value=5), min_size=2, max_size=2)
            | st.lists(st.floats(max_value=0, allow_nan=False, allow_infinity=False), min_size=3, max_size=6))
    body = json.dumps(batch, allow_nan=True).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity") \
        .replace('"-Infinity"', "-Infinity")
    return kind, body.encode()


@SETTINGS
@given(case=broken_batches())
def test_broken_batches_get_a_4xx_and_change_nothing(live, case):
    kind, body = case
    before = _digest(live[0].db)
    resp = live[1].post("/batch", content=body)
    _assert_refused(live, kind, resp, before, {400, 422})


@SETTINGS
@given(cut=st.integers(min_value=0, max_value=10_000), garbage=st.binary(max_size=40))
def test_truncated_or_garbled_json_is_a_400(live, cut, garbage):
    body = json.dumps(_valid_batch()).encode()
    body = body[:cut % len(body)] + garbage
    before = _digest(live[0].db)
    resp = live[1].post("/batch", content=body)
    _assert_refused(live, "malformed_json", resp, before, {400, 422})


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(extra=st.integers(min_value=1, max_value=4 * LIMIT), chunked=st.booleans())
def test_huge_bodies_are_a_413(live, extra, chunked):
    payload = b'{"ops": [' + b" " * (LIMIT + extra) + b"]}"
    before = _digest(live[0].db)
    content = (payload[i:i + 65536] for i in range(0, len(payload), 65536)) if chunked else payload
    resp = live[1].post("/batch", content=content)
    _assert_refused(live, "huge_body", resp, before, {413})


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)


@SETTINGS
@given(token=header_text.filter(lambda t: t.strip() != TOKEN), scheme=st.sampled_from(["Bearer", "Basic", "", "bearer"]))
def test_bad_tokens_are_a_401(live, token, scheme):
    server, _ = live
    before = _digest(server.db)
    resp = httpx.post(f"{server.url}/v1/batch", content=json.dumps(_valid_batch()),
                      headers={"authorization": f"{scheme} {token}".strip()})
    _assert_refused(live, "bad_token", resp, before, {401})


def test_a_header_with_control_bytes_is_refused_by_the_http_layer(live):
    server, client = live
    before = _digest(server.db)
    body = json.dumps(_valid_batch()).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # httpx refuses to send it
        sock.sendall(b"POST /v1/batch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \x1b\x00\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        status = int(sock.recv(4096).split(b" ", 2)[1])
    _record("bad_token", status)
    assert status == 400 and client.get("/health").status_code == 200 and _digest(server.db) == before


WRITE_ROUTES = ["/batch", "/rewards", "/rollout_data", "/queue/enqueue", "/queue/lease", "/queue/heartbeat",
                "/queue/complete", "/queue/cancel", "/queue/entries"]


@SETTINGS
@given(route=st.sampled_from(WRITE_ROUTES), value=json_values)
def test_arbitrary_json_never_breaks_the_server(live, route, value):
    server, client = live
    resp = client.post(route, content=json.dumps(value))
    _record(f"arbitrary_json {route}", resp.status_code)
    assert resp.status_code < 500, resp.text[:500]
    if resp.status_code >= 400:
        assert resp.json()["error"]
    assert client.get("/health").status_code == 200


@SETTINGS
@given(params=st.dictionaries(st.sampled_from(["mode", "status", "since", "limit", "min_policy_version",
                                                "newest_first"]), st.text(max_size=10), max_size=4),
       rollout_id=st.text(max_size=30))
def test_arbitrary_queries_never_break_the_server(live, params, rollout_id):
    server, client = live
    for resp in (client.get("/rollouts", params=params),
                 client.get(f"/rollouts/{urllib.parse.quote(rollout_id, safe='') or 'x'}/spans"),
                 client.get("/rollouts/known/trajectory", params={"credit": rollout_id})):
        _record("arbitrary_query", resp.status_code)
        assert resp.status_code < 500, resp.text[:500]


def test_the_fuzzed_server_still_holds_exactly_the_seed(live):
    server, client = live
    assert [r["rollout_id"] for r in client.get("/rollouts").json()] == ["known"]
    assert len(client.get("/rollouts/known/spans").json()) == 1 and client.get("/rollouts/known/rewards").json() == []
