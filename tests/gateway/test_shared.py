"""Two gateways behind a plain balancer (``--shared``): a rollout opened on one goes on through the other,
in one rollout with its calls in order; one of them killed outright (kill -9) mid-rollout loses nothing
the agent was answered. Real gateway processes over one store (a SQLite file; a store server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import BackgroundGateway
from lightning_rl.records import RolloutStatus
from lightning_rl.serving import ServerThread
from lightning_rl.store import SQLiteStore
from lightning_rl.vllm_server import free_port

pytest.importorskip("fastapi")

from ..services import wait_healthy  # noqa: E402
from .test_upstreams import fake_engine  # noqa: E402

TOKEN = "shared-gateway-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _gateway(engine_url: str, store: str, tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path / f"spill-{name}"))
    proc = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "gateway", "--shared", "--token", TOKEN,
                             "--upstream", engine_url, "--store", store, "--port", str(port)],
                            env=env, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, what=f"gateway {name}")
    return proc, url


def _call(url: str, key: str, messages: list[dict]) -> httpx.Response:
    """A call the way an agent behind the balancer makes it: /v1, its key as the bearer token."""
    return httpx.post(f"{url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                      json={"model": "m", "messages": messages, "temperature": 0, "max_tokens": 4})


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


@pytest.fixture(params=["sqlite", "server"])
def shared_store(request, tmp_path):
    """(the --store the gateways get, a store reading what they wrote)."""
    db = tmp_path / "runs.db"
    if request.param == "sqlite":
        yield f"sqlite:///{db}", lambda: SQLiteStore(db, read_only=True)
        return
    from lightning_rl.store.http.server import BackgroundServer

    with BackgroundServer(db) as server:
        yield server.url, lambda: SQLiteStore(db, read_only=True)


@pytest.fixture
def fake():
    """A fake engine on a thread, and the user messages it was sent."""
    hits: list[str] = []
    engine = ServerThread(fake_engine("e", hits), name="fake-e")
    engine.start("a fake engine")
    yield engine, hits
    engine.stop()


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_a_rollout_opened_on_one_gateway_goes_on_through_the_other_in_order(shared_store, fake, tmp_path):
    store_arg, reader = shared_store
    engine, hits = fake
    (a, url_a), (b, url_b) = (_gateway(engine.url, store_arg, tmp_path, n) for n in ("a", "b"))
    try:
        opened = httpx.post(f"{url_a}/v1/rollouts", headers=ADMIN, json={"task": {"q": 1}, "agent": "solver"}).json()
        rid, key = opened["rollout_id"], opened["api_key"]
        assert key.startswith("lrl-")
        tool_call = {"id": "call-1", "type": "function", "function": {"name": "search", "arguments": "{\"q\": 1}"}}
        history = [_user("one")]
        assert _call(url_a, key, history).status_code == 200
        history += [{"role": "assistant", "content": None, "tool_calls": [tool_call]},
                    {"role": "tool", "tool_call_id": "call-1", "content": "found"}, _user("two")]
        assert _call(url_b, key, history).status_code == 200  # the tool message: a tool span, on B
        history += [{"role": "assistant", "content": "e"}, _user("three")]
        assert _call(url_a, key, history).status_code == 200  # the same tool message again: no second span
        mid = httpx.post(f"{url_b}/v1/rollouts/{rid}/rewards", headers={"Authorization": f"Bearer {key}"},
                         json={"value": 0.5, "name": "step"})
        assert mid.json()["llm_call_index"] == 2, mid.text  # the latest call, made on A
        # the rollout's own base URL, as A answered it, reaches the same rollout through B
        path = opened["base_url"].removeprefix(url_a)
        assert httpx.post(f"{url_b}{path}/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
            "model": "m", "messages": history + [{"role": "assistant", "content": "e"}, _user("four")]}).status_code == 200
        done = httpx.post(f"{url_a}/v1/rollouts/{rid}/finish", headers={"Authorization": f"Bearer {key}"},
                          json={"status": "succeeded", "reward": 1.0})
        assert done.status_code == 200, done.text
        assert _call(url_b, key, [_user("late")]).status_code == 409  # finished on A: B knows it from the store
        assert httpx.post(f"{url_b}/v1/rollouts/{rid}/finish", headers={"Authorization": f"Bearer {key}"},
                          json={}).status_code == 409
        assert hits == ["one", "two", "three", "four"]
        with reader() as db:
            traj = lrl.trajectory(db, rid)
            spans = db.spans(rid)
            rewards = db.rewards(rid)
        assert traj.status == RolloutStatus.SUCCEEDED and traj.final_reward == 1.0
        assert [c.index for c in traj.llm_calls] == [0, 1, 2, 3]
        assert [c.input_messages[-1]["content"] for c in traj.llm_calls] == ["one", "two", "three", "four"]
        assert all(c.prompt_token_ids == [1, 2, 3] and c.response_token_ids == [7] for c in traj.llm_calls)
        assert sorted(s.seq for s in spans) == [s.seq for s in sorted(spans, key=lambda s: s.start_ns)]
        tools = [s for s in spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL]
        assert [s.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) for s in tools] == ["call-1"]
        roots = [s for s in spans if s.parent_id is None]
        assert len(roots) == 1 and roots[0].name == "invoke_agent solver"
        assert {s.trace_id for s in spans} == {roots[0].trace_id}
        assert all(s.parent_id == roots[0].span_id for s in spans if s is not roots[0])
        assert sorted((r.name, r.value, r.llm_call_index) for r in rewards) == [("reward", 1.0, None),
                                                                               ("step", 0.5, 2)]
    finally:
        _stop(a, b)


def test_a_gateway_killed_mid_rollout_loses_nothing_the_other_finishes_it(shared_store, fake, tmp_path):
    store_arg, reader = shared_store
    engine, hits = fake
    (a, url_a), (b, url_b) = (_gateway(engine.url, store_arg, tmp_path, n) for n in ("a", "b"))
    try:
        opened = httpx.post(f"{url_a}/v1/rollouts", headers=ADMIN, json={"task": "t"}).json()
        rid, key = opened["rollout_id"], opened["api_key"]
        auth = {"Authorization": f"Bearer {key}"}
        assert _call(url_a, key, [_user("one")]).status_code == 200
        assert _call(url_b, key, [_user("two")]).status_code == 200
        assert _call(url_a, key, [_user("three")]).status_code == 200
        assert httpx.post(f"{url_a}/v1/rollouts/{rid}/rewards", headers=auth, json={"value": 0.25}).status_code == 200
        os.killpg(a.pid, signal.SIGKILL)  # no graceful stop, nothing flushed on the way out
        a.wait(30)
        assert _call(url_b, key, [_user("four")]).status_code == 200
        done = httpx.post(f"{url_b}/v1/rollouts/{rid}/finish", headers=auth, json={"reward": 1.0})
        assert done.status_code == 200, done.text
        with reader() as db:
            traj = lrl.trajectory(db, rid)
            rewards = sorted((r.value, r.llm_call_index) for r in db.rewards(rid))
        assert traj.status == RolloutStatus.SUCCEEDED
        assert [(c.index, c.input_messages[-1]["content"]) for c in traj.llm_calls] == [
            (0, "one"), (1, "two"), (2, "three"), (3, "four")]
        assert rewards == [(0.25, 2), (1.0, None)]
    finally:
        _stop(a, b)


def test_shared_keys_open_only_their_own_rollout_and_a_forged_one_nothing(traced, fake):
    engine, hits = fake
    with BackgroundGateway([engine.url], token=TOKEN, shared=True) as one, \
            BackgroundGateway([engine.url], token=TOKEN, shared=True) as two, \
            BackgroundGateway([engine.url], token="another token", shared=True) as other:
        first = httpx.post(f"{one.url}/v1/rollouts", headers=ADMIN, json={"task": 1}).json()
        second = httpx.post(f"{one.url}/v1/rollouts", headers=ADMIN, json={"task": 2}).json()
        key = first["api_key"]
        refused = httpx.post(f"{two.url}/rollouts/{second['rollout_id']}/v1/chat/completions",
                             headers={"Authorization": f"Bearer {key}"},
                             json={"model": "m", "messages": [_user("x")]})
        assert refused.status_code == 403
        forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        assert _call(two.url, forged, [_user("x")]).status_code == 401
        assert _call(other.url, key, [_user("x")]).status_code == 401  # another token: not its key
        assert hits == []
        assert _call(two.url, key, [_user("y")]).status_code == 200
        assert httpx.get(f"{two.url}/v1/upstreams").status_code == 401
        assert httpx.get(f"{two.url}/v1/upstreams", headers=ADMIN).json() == {"upstreams": [engine.url]}


def test_shared_without_a_token_is_refused_in_one_line():
    from lightning_rl.cli import main

    result = CliRunner().invoke(main, ["gateway", "--shared", "--upstream", "http://127.0.0.1:9"])
    assert result.exit_code != 0
    assert "--shared needs --token" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.vllm
def test_two_gateways_over_vllm_record_one_rollout_streamed_and_not(vllm_url, tmp_path):
    """The real engine: a call on A, a streamed call on B (stored before B sends the stream's end), a
    finish on A; the engine's token ids on every call, in one rollout."""
    import openai

    from ..conftest import SERVED_NAME

    db = tmp_path / "runs.db"
    (a, url_a), (b, url_b) = (_gateway(vllm_url, f"sqlite:///{db}", tmp_path, n) for n in ("a", "b"))
    try:
        opened = httpx.post(f"{url_a}/v1/rollouts", headers=ADMIN, json={"task": {"q": "12+30"}}).json()
        greedy = dict(temperature=0.0, seed=0, max_tokens=8)
        question = [_user("What is 12+30?")]
        on_a = openai.OpenAI(base_url=f"{url_a}/v1", api_key=opened["api_key"])
        on_b = openai.OpenAI(base_url=f"{url_b}/v1", api_key=opened["api_key"])
        plain = on_a.chat.completions.create(model=SERVED_NAME, messages=question, **greedy)
        streamed = "".join(c.choices[0].delta.content or "" for c in on_b.chat.completions.create(
            model=SERVED_NAME, messages=question, stream=True, **greedy) if c.choices)
        assert streamed == plain.choices[0].message.content
        with SQLiteStore(db, read_only=True) as db_now:  # the stream's call is stored once its end is sent
            assert db_now.llm_call_counts([opened["rollout_id"]]) == {opened["rollout_id"]: 2}
        done = httpx.post(f"{url_a}/v1/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0},
                          headers={"Authorization": f"Bearer {opened['api_key']}"})
        assert done.status_code == 200, done.text
        with SQLiteStore(db, read_only=True) as reader:
            traj = lrl.trajectory(reader, opened["rollout_id"])
        assert traj.status == RolloutStatus.SUCCEEDED and traj.final_reward == 1.0
        assert [(c.index, c.streamed) for c in traj.llm_calls] == [(0, False), (1, True)]
        assert traj.llm_calls[0].response_token_ids == traj.llm_calls[1].response_token_ids != []
        assert all(c.prompt_token_ids and c.response_logprobs for c in traj.llm_calls)
    finally:
        _stop(a, b)


def test_a_gateway_stopped_gracefully_leaves_its_shared_rollouts_open_for_the_others(traced, fake):
    """A rolling restart: a shared gateway that stops ends none of the rollouts (a lone gateway ends
    them failed: their keys die with it); another finishes them."""
    engine, hits = fake
    with BackgroundGateway([engine.url], token=TOKEN, shared=True) as two:
        with BackgroundGateway([engine.url], token=TOKEN, shared=True) as one:
            opened = httpx.post(f"{one.url}/v1/rollouts", headers=ADMIN, json={"task": 1}).json()
            assert _call(one.url, opened["api_key"], [_user("one")]).status_code == 200
        traced.flush()
        assert traced.get_rollout(opened["rollout_id"]).status == RolloutStatus.RUNNING
        assert _call(two.url, opened["api_key"], [_user("two")]).status_code == 200
        done = httpx.post(f"{two.url}/v1/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0},
                          headers={"Authorization": f"Bearer {opened['api_key']}"})
        assert done.status_code == 200, done.text
    traj = lrl.trajectory(traced, opened["rollout_id"])
    assert traj.status == RolloutStatus.SUCCEEDED and [c.index for c in traj.llm_calls] == [0, 1]
