"""The store server and its HTTP client: auth, limits, validation, idempotency, spill and replay.

Every test talks to a real uvicorn server on a loopback port over a real SQLite file."""

from __future__ import annotations

import base64
import json
import os
import socket
import sqlite3
import struct
import subprocess
import sys
import time

import httpx
import orjson
import pytest

import lightning_rl as lrl
from lightning_rl.records import Rollout, RolloutStatus
from lightning_rl.store import wait_for_groups
from lightning_rl.store.http.client import HttpStore
from lightning_rl.serving import STORE_SERVER, check_bind
from lightning_rl.store.http.server import BackgroundServer

from .helpers import llm_span

TOKEN = "s3cret-token"


def _span_op(rollout_id: str, seq: int, **attrs) -> dict:
    span = llm_span(rollout_id, seq, seq, [1, 2, 3], [4, 5]).model_dump(mode="json")
    span["attributes"].update(attrs)
    return {"op": "span", "span": span}


def _packed(prompt, response, logprobs) -> dict:
    """Token arrays in the wire's packed form (what HttpStore sends), built without our encoder."""
    lp = None if logprobs is None else base64.b64encode(b"d" + struct.pack(f"<{len(logprobs)}d", *logprobs)).decode()
    return {"prompt": base64.b64encode(struct.pack(f"<{len(prompt)}i", *prompt)).decode(),
            "response": base64.b64encode(struct.pack(f"<{len(response)}i", *response)).decode(), "logprobs": lp}


def _start_op(rollout_id: str) -> dict:
    return {"op": "start_rollout", "rollout": Rollout(rollout_id=rollout_id, task={"q": 1}).model_dump(mode="json")}


def _rows(db) -> tuple[int, int, int]:
    conn = sqlite3.connect(db)
    try:
        return tuple(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("rollouts", "spans", "rewards"))
    finally:
        conn.close()


@pytest.fixture
def server(tmp_path):
    with BackgroundServer(tmp_path / "served.db", token=TOKEN, max_body_bytes=2**20) as srv:
        srv.db = tmp_path / "served.db"
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url + "/v1", headers={"authorization": f"Bearer {TOKEN}"}) as client:
        yield client


def test_token_is_required_and_checked(server):
    body = {"ops": [_start_op("r1")]}
    assert httpx.post(f"{server.url}/v1/batch", json=body).status_code == 401
    wrong = httpx.post(f"{server.url}/v1/batch", json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "wrong bearer token" in wrong.json()["error"]
    assert httpx.get(f"{server.url}/v1/health").status_code == 200  # health and the schema are open
    assert "/v1/batch" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert _rows(server.db) == (0, 0, 0)


def test_binding_beyond_loopback_needs_a_token():
    check_bind(STORE_SERVER, "127.0.0.1", None)
    check_bind(STORE_SERVER, "::1", None)
    check_bind(STORE_SERVER, "0.0.0.0", "t")
    with pytest.raises(lrl.ConfigurationError, match="give it a token"):
        check_bind(STORE_SERVER, "0.0.0.0", None)


def test_a_batch_is_written_once_however_often_it_is_sent(server, http):
    reward = {"op": "reward", "reward": {"rollout_id": "r1", "value": 1.0, "uid": "u-1"}}
    finish = {"op": "finish_rollout", "rollout_id": "r1", "status": "succeeded", "end_time": time.time()}
    body = {"ops": [_start_op("r1"), _span_op("r1", 0), _span_op("r1", 1), reward, finish]}
    for _ in range(3):  # a client retrying a batch whose answer it lost
        resp = http.post("/batch", json=body)
        assert resp.status_code == 200 and resp.json() == {"accepted": 5}
    assert _rows(server.db) == (1, 2, 1)
    assert server.store.get_rollout("r1").status == RolloutStatus.SUCCEEDED


@pytest.mark.parametrize("mutate, status, message", [
    (lambda ops: ops[1]["span"].update(seq="1"), 422, "ops[1] (span op): span.seq"),
    (lambda ops: ops[1]["span"]["tokens"].update(prompt_ids=[1, -5]), 422, "greater than or equal to 0"),
    (lambda ops: ops[1]["span"]["tokens"].update(response_logprobs=[-0.1]), 422, "1 log-probs for 2 response tokens"),
    (lambda ops: ops[1]["span"].update(tokens=_packed([1, -5], [4, 5], [-0.1, -0.2])), 422, "must be >= 0"),
    (lambda ops: ops[1]["span"].update(tokens=_packed([1, 2], [4, 5], [-0.1])), 422, "1 log-probs for 2 response"),
    (lambda ops: ops[1]["span"].update(tokens={**_packed([1], [4], [-0.1]), "prompt": "AQID"}), 422,
     "4 bytes each"),
    (lambda ops: ops[1]["span"].update(tokens={**_packed([1], [4], None), "logprobs": "eAAAAAA="}), 422,
     "type byte"),
    (lambda ops: ops[1]["span"].update(tokens=_packed([1], [4, 5], [0.5, -0.1])), 422, "finite and <= 0"),
    (lambda ops: ops[1]["span"].update(tokens=_packed([1], [4], [float("nan")])), 422, "finite and <= 0"),
    (lambda ops: ops[1]["span"].update(tokens=_packed([1], [4, 5], [float("-inf"), float("inf")])), 422,
     "finite and <= 0"),
    # token arrays as attributes: how clients before 0.2 sent them
    (lambda ops: ops[1]["span"].update(tokens=None, attributes={"lightning_rl.prompt_token_ids": [1, -5]}), 422,
     "greater than or equal to 0"),
    (lambda ops: ops[1]["span"].update(tokens=None, attributes={"lightning_rl.response_token_ids": [4, 5],
                                                                 "lightning_rl.response_logprobs": [-0.1]}), 422,
     "1 log-probs for 2 response tokens"),
    (lambda ops: ops[1]["span"].update(trace_id="xyz"), 422, "32 lowercase hex digits"),
    (lambda ops: ops.append({"op": "reward", "reward": {"rollout_id": "r1", "value": "NaN"}}), 422, "reward"),
    (lambda ops: ops.append({"op": "span", "span": _span_op("ghost", 0)["span"]}), 422, "unknown rollout id(s) 'ghost'"),
    (lambda ops: ops.append({"op": "finish_rollout", "rollout_id": "r1", "status": "running", "end_time": 1.0}), 422,
     "finishes as succeeded"),
    (lambda ops: ops.append({"op": "teleport"}), 422, "op"),
])
def test_bad_content_is_refused_whole_with_a_clear_422(server, http, mutate, status, message):
    ops = [_start_op("r1"), _span_op("r1", 0)]
    mutate(ops)
    resp = http.post("/batch", content=orjson.dumps({"ops": ops}, option=orjson.OPT_SERIALIZE_NUMPY))
    assert resp.status_code == status, resp.text
    assert message in json.dumps(resp.json())
    assert _rows(server.db) == (0, 0, 0)  # nothing of a refused batch is written


def test_malformed_json_and_oversized_bodies(server, http):
    resp = http.post("/batch", content=b'{"ops": [')
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]
    big = b'{"ops": [' + b" " * (2**20 + 10) + b"]}"
    resp = http.post("/batch", content=big)
    assert resp.status_code == 413 and "over the server's limit" in resp.json()["error"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(40):
            yield b" " * 65536

    resp = http.post("/batch", content=chunked())
    assert resp.status_code == 413
    assert httpx.get(f"{server.url}/v1/health").json()["ok"] is True


def test_queries_queue_and_late_rewards_through_the_client(server, tmp_path):
    client = HttpStore(server.url, token=TOKEN, spill_dir=tmp_path / "spill", retry_for=2)
    lrl.configure(store=client)

    @lrl.trace
    def agent(task):
        with lrl.tool_span("lookup", arguments={"k": task["k"]}):
            pass
        return 1.0

    entries = client.enqueue({"k": 1}, n=2)
    leased = client.lease("r-a", limit=2)
    assert {e.queue_id for e in leased} == {e.queue_id for e in entries}
    for entry in leased:
        with lrl.rollout_overrides(rollout_id=entry.rollout_id, group_id=entry.group_id, task=entry.task):
            agent(entry.task)
        assert client.complete(entry.queue_id, "r-a", "succeeded")
    assert wait_for_groups(client, [entries[0].group_id], timeout=5)
    rid = leased[0].rollout_id
    late = client.add_reward(rid, -1.0, name="user_feedback", uid="fb-1")
    client.add_reward(rid, -1.0, name="user_feedback", uid="fb-1")  # a retried feedback call: stored once
    assert late.uid == "fb-1" and [r.name for r in client.rewards(rid)] == ["reward", "user_feedback"]
    trajs = list(lrl.trajectories(client, reward_name="user_feedback"))
    assert len(trajs) == 2 and {t.final_reward for t in trajs} == {-1.0, None}
    with pytest.raises(lrl.RolloutNotFoundError):
        client.get_rollout("ghost")
    with pytest.raises(ValueError, match="finite"):
        client.add_reward(rid, float("nan"))
    client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_down_spills_locally_and_replays_in_order(tmp_path):
    port = _free_port()
    client = HttpStore(f"http://127.0.0.1:{port}", spill_dir=tmp_path / "spill", retry_for=5)
    lrl.configure(store=client)

    @lrl.trace
    def agent(task):
        for i in range(3):
            with lrl.tool_span("step", arguments={"i": i}):
                pass
        lrl.emit_reward(0.5, name="mid")
        return 1.0

    t0 = time.monotonic()
    for i in range(5):
        agent({"i": i})  # no server at all: the agent goes on
    assert time.monotonic() - t0 < 5  # one ~1 s wait for the first batch, then straight to the spill file
    assert client.spill_files and lrl.stats().get("spilled_ops", 0) > 0
    with BackgroundServer(tmp_path / "late.db", port=port) as srv:
        agent({"i": 5})  # written after the backlog, which is replayed first, within about a second
        deadline = time.monotonic() + 10
        while client.spill_files and time.monotonic() < deadline:
            time.sleep(0.1)
        client.flush()
        assert not client.spill_files
        rollouts = srv.store.rollouts()
        assert len(rollouts) == 6 and {r.status for r in rollouts} == {RolloutStatus.SUCCEEDED}
        assert all(len(srv.store.spans(r.rollout_id)) == 4 and len(srv.store.rewards(r.rollout_id)) == 2
                   for r in rollouts)
    client.close()


def test_a_batch_the_database_could_not_take_is_not_acknowledged(tmp_path):
    # The server's file is locked: the batch lands in the server's spill file, which is not the
    # database. Answering 200 would let another worker refuse later ops of the same rollout (422).
    db = tmp_path / "locked.db"
    options = dict(busy_timeout=0.05, give_up_after=0.3)
    with BackgroundServer(db, store_options=options) as srv, httpx.Client(base_url=srv.url + "/v1") as http:
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        body = {"ops": [_start_op("r1"), _span_op("r1", 0)]}
        first = http.post("/batch", json=body, timeout=30)
        assert first.status_code == 503 and "retry" in first.json()["error"]
        blocker.execute("ROLLBACK")
        blocker.close()
        deadline = time.monotonic() + 15
        while (again := http.post("/batch", json=body, timeout=30)).status_code == 503:  # what a client does
            assert time.monotonic() < deadline, "the server's backlog was not written back"
            time.sleep(0.2)
        assert again.status_code == 200 and not srv.store.spill_files
        assert http.post("/batch", json={"ops": [{"op": "finish_rollout", "rollout_id": "r1", "status": "succeeded",
                                                   "end_time": 2.0, "error": None}]}).status_code == 200
        srv.store.flush()
        assert _rows(db)[:2] == (1, 1)
        assert srv.store.get_rollout("r1").status == RolloutStatus.SUCCEEDED


def test_complete_never_overtakes_the_records_it_reports_on(tmp_path):
    port = _free_port()
    db = tmp_path / "queue.db"
    client = HttpStore(f"http://127.0.0.1:{port}", spill_dir=tmp_path / "spill", retry_for=20)
    with BackgroundServer(db, port=port):
        (entry,) = client.enqueue({"q": 1}, n=1)
        (leased,) = client.lease("r1", lease_seconds=60)
    lrl.configure(store=client)

    @lrl.trace
    def agent(task):
        return 1.0

    with lrl.rollout_overrides(rollout_id=leased.rollout_id, group_id=leased.group_id, task=leased.task):
        agent(leased.task)  # the server is down: the rollout is in the local spill file
    assert client.spill_files
    with BackgroundServer(db, port=port) as srv:
        assert client.complete(leased.queue_id, "r1", RolloutStatus.SUCCEEDED)
        # the outcome says succeeded only once the rollout it describes is on the server
        assert srv.store.get_rollout(leased.rollout_id).status == RolloutStatus.SUCCEEDED
    client.close()


def test_a_server_that_never_answers_costs_the_agent_about_a_second(tmp_path):
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # accepts connections (the kernel does), never answers
    client = HttpStore(f"http://127.0.0.1:{hung.getsockname()[1]}", spill_dir=tmp_path / "spill", retry_for=1)
    lrl.configure(store=client)

    @lrl.trace
    def agent(task):
        with lrl.tool_span("step"):
            pass
        return 1.0

    waits = []
    for i in range(4):
        t0 = time.monotonic()
        agent({"i": i})
        waits.append(time.monotonic() - t0)
    assert waits[0] < 2.5 and max(waits[1:]) < 1.5, waits
    assert client.spill_files  # nothing lost: everything is waiting in the spill file
    client.close()
    hung.close()


def test_refused_records_are_kept_aside_not_dropped(server, tmp_path):
    client = HttpStore(server.url, token=TOKEN, spill_dir=tmp_path / "spill", retry_for=2)
    client.add_spans([llm_span("never-started", 0, 0, [1], [2])])  # no start_rollout: the server says 422
    rejected = list((tmp_path / "spill").glob("rejected-*.jsonl"))
    assert len(rejected) == 1
    reason, *ops = rejected[0].read_bytes().splitlines()
    assert "unknown rollout id" in orjson.loads(reason)["reason"] and len(ops) == 1
    assert lrl.stats().get("rejected_ops", 0) >= 1
    client.close()


def test_refused_records_are_never_taken_for_a_dead_process_spill(server, tmp_path):
    """A user trial's blocker: records refused for a wrong token went to rejected-* files; the next process on
    the same spill folder adopted those as a dead process's spill (the name's timestamp read as a pid),
    renamed them all to one name (all but one lost), replayed them (refused again), and then held every record
    of its own behind that backlog: a healthy server got nothing."""
    spill = tmp_path / "spill"
    code = f"""
import lightning_rl as lrl, os, time
from lightning_rl.records import Rollout
from lightning_rl.store.http.client import HttpStore
client = HttpStore({server.url!r}, token="WRONG", spill_dir={str(spill)!r}, retry_for=1)
for i in range(3):
    client.start_rollout(Rollout(rollout_id=f"refused-{{i}}"))
    client.flush()
    time.sleep(0.01)
client.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    rejected = sorted(spill.glob("rejected-*.jsonl"))
    assert len(rejected) == 3 and "token" in orjson.loads(rejected[0].read_bytes().splitlines()[0])["reason"]
    client = HttpStore(server.url, token=TOKEN, spill_dir=spill, retry_for=2)
    assert client.spill_files == [] and client.rejected_files == rejected  # kept as they were, not adopted
    client.start_rollout(Rollout(rollout_id="mine"))
    assert client.flush(10) and client.spill_files == []
    assert [r.rollout_id for r in server.store.rollouts()] == ["mine"]  # delivered at once
    assert sorted(spill.glob("rejected-*.jsonl")) == rejected  # every refused record still kept, with its reason
    client.close()
    from click.testing import CliRunner

    from lightning_rl.cli import main

    doctor = CliRunner().invoke(main, ["store", "doctor", "--store", server.url],
                                env={"LIGHTNING_RL_STORE_TOKEN": TOKEN, "LIGHTNING_RL_SPILL_DIR": str(spill)})
    assert doctor.exit_code == 1 and "3 file(s) of records the store server refused" in doctor.output


def test_spill_files_of_a_dead_process_are_adopted_and_replayed(server, tmp_path):
    spill = tmp_path / "spill"
    code = f"""
import lightning_rl as lrl, os
from lightning_rl.store.http.client import HttpStore
client = HttpStore("http://127.0.0.1:1", spill_dir={str(spill)!r}, retry_for=1)
lrl.configure(store=client)
@lrl.trace
def agent(task):
    return 1.0
agent({{"q": 1}})
os._exit(0)  # dies without replaying
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert len(list(spill.glob("*.jsonl"))) >= 1
    client = HttpStore(server.url, token=TOKEN, spill_dir=spill, retry_for=2)
    assert client.spill_files  # adopted from the dead process
    client.start_rollout(Rollout(rollout_id="mine"))
    client.flush()
    assert not list(spill.glob("*.jsonl"))
    assert {r.rollout_id for r in server.store.rollouts()} >= {"mine"} and len(server.store.rollouts()) == 2
    client.close()


def test_cli_serves_a_store_that_runners_use(tmp_path):
    port = _free_port()
    env = dict(os.environ, LIGHTNING_RL_STORE_TOKEN=TOKEN)
    server = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db",
                               str(tmp_path / "cli.db"), "--port", str(port)], env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"{url}/v1/health")
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert health.json()["synchronous"] == "full"  # an acknowledged batch survives a power loss
        client = HttpStore(url, token=TOKEN, spill_dir=tmp_path / "spill")
        group = client.enqueue({"a": 2, "b": 3}, n=3)[0].group_id
        done = subprocess.run(
            [sys.executable, "-m", "lightning_rl.cli", "runner", "--agent", "tests.store.server_agents:add",
             "--store", url, "--concurrency", "2", "--max-rollouts", "3"],
            env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert wait_for_groups(client, [group], timeout=10)
        trajs = list(lrl.trajectories(client))
        assert len(trajs) == 3 and all(t.final_reward == 1.0 and len(t.tool_spans) == 1 for t in trajs)
        client.close()
    finally:
        server.terminate()
        server.wait(30)


def test_a_forked_child_writes_through_its_own_connection(server, tmp_path):
    client = HttpStore(server.url, token=TOKEN, spill_dir=tmp_path / "spill", retry_for=5)
    lrl.configure(store=client)

    @lrl.trace
    def agent(task):
        return 1.0

    agent({"who": "parent"})
    pid = os.fork()
    if pid == 0:  # the child: the store was re-opened after the fork (new connection and writer)
        try:
            agent({"who": "child"})
            client.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    agent({"who": "parent again"})
    client.flush()
    tasks = sorted(r.task["who"] for r in server.store.rollouts())
    assert tasks == ["child", "parent", "parent again"]
    client.close()


def test_the_environment_alone_sends_an_unchanged_agent_to_the_server(server, tmp_path):
    env = dict(os.environ, LIGHTNING_RL_STORE=server.url, LIGHTNING_RL_STORE_TOKEN=TOKEN,
               LIGHTNING_RL_SPILL_DIR=str(tmp_path / "spill"))
    code = "import lightning_rl as lrl\n@lrl.trace\ndef solve(task):\n    return 1.0\nsolve({'q': 'env'})\n"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert [r.task for r in server.store.rollouts()] == [{"q": "env"}]
    listed = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "rollouts", "ls", "--json"], env=env,
                            capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(listed.stdout.splitlines()[0])["task"] == {"q": "env"}


def test_trainer_worker_processes_lease_through_the_server(server, tmp_path, monkeypatch):
    from lightning_rl.trainer_bridge.runner import run_in_processes

    from .server_agents import add

    monkeypatch.setenv("LIGHTNING_RL_STORE_TOKEN", TOKEN)
    monkeypatch.setenv("LIGHTNING_RL_SPILL_DIR", str(tmp_path / "spill"))
    client = HttpStore(server.url, spill_dir=tmp_path / "spill-test")
    groups = [client.enqueue({"a": i, "b": 1}, n=2)[0].group_id for i in range(4)]
    assert run_in_processes(server.url, add, groups, processes=2) == [0, 0]
    entries = client.queue_entries(groups)
    assert len(entries) == 8 and all(e.outcome == RolloutStatus.SUCCEEDED for e in entries)
    assert len(list(lrl.trajectories(client, status="succeeded"))) == 8
    client.close()


def _drop_answers(client: HttpStore, path: str, times: int = 1) -> list[int]:
    """The server does the work of the next `times` requests to `path` and the answer never comes back
    (a server killed between its commit and its reply). Returns the list the dropped requests are counted in."""
    connection = client._servers._clients[0]  # the first server's connection
    real_send, dropped = connection.send, []

    def send(request, **kwargs):
        response = real_send(request, **kwargs)
        if request.url.path.endswith(path) and len(dropped) < times:
            response.read()
            dropped.append(response.status_code)
            raise httpx.ReadError("connection closed before the answer", request=request)
        return response

    connection.send = send
    return dropped


def test_a_lease_whose_answer_was_lost_is_handed_to_its_retry(server, tmp_path):
    """Reproduces the CI failure of test_server_killed_and_restarted_under_load: the server leased
    entries and died before answering; the client's retry must get those entries, not strand them
    (leased to nobody until the lease expires, and re-issued only if some runner still asks then)."""
    client = HttpStore(server.url, token=TOKEN, spill_dir=tmp_path / "spill", retry_for=5)
    entries = client.enqueue({"q": 1}, n=3)
    dropped = _drop_answers(client, "/queue/lease")
    leased = client.lease("r-a", lease_seconds=600, limit=2)
    assert dropped == [200]  # the first answer was lost after the server had leased two entries
    assert len(leased) == 2
    rest = client.lease("r-a", lease_seconds=600, limit=5)  # a new call is a new lease
    assert {e.queue_id for e in leased} | {e.queue_id for e in rest} == {e.queue_id for e in entries}
    assert not {e.queue_id for e in leased} & {e.queue_id for e in rest}
    stored = server.store.queue_entries([entries[0].group_id])
    assert sorted(e.tries for e in stored) == [1, 1, 1]  # the retry did not count as another try
    client.close()


def test_a_completion_whose_answer_was_lost_still_reads_done(server, tmp_path):
    client = HttpStore(server.url, token=TOKEN, spill_dir=tmp_path / "spill", retry_for=5)
    (entry,) = client.enqueue({"q": 1}, n=1)
    (leased,) = client.lease("r-a", lease_seconds=600)
    dropped = _drop_answers(client, "/queue/complete")
    assert client.complete(leased.queue_id, "r-a", "succeeded")  # the retry sees its own completion
    assert dropped == [200]
    assert not client.complete(leased.queue_id, "r-b", "succeeded")  # another runner's word is still refused
    assert not client.complete(leased.queue_id, "r-a", "failed")  # and so is a different outcome
    (done,) = server.store.queue_entries([entry.group_id])
    assert done.status.value == "done" and done.outcome == RolloutStatus.SUCCEEDED
    client.close()
