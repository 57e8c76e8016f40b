"""Model names: a gateway started with ``model`` (``--model``) sends every call as that served model,
whatever name the agent asked for (coding CLIs ask for their vendor's), keeping the name asked on the call;
a rollout opened with a model of its own wins; ``--shared`` gateways refuse a per-rollout model (the
store's record has no place for it) with a 422 that names the fix."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.errors import ConfigurationError
from lightning_rl.gateway import BackgroundGateway
from lightning_rl.serving import ServerThread

pytest.importorskip("fastapi")

from fastapi import FastAPI, Request  # noqa: E402  (module level: FastAPI reads the handler's annotations)

from .test_upstreams import fake_engine  # noqa: E402


@pytest.fixture
def engine():
    engine = ServerThread(fake_engine("e", []), name="fake-e")
    engine.start("a fake engine")
    yield engine
    engine.stop()


def _call(opened: dict, model: str) -> httpx.Response:
    return httpx.post(opened["base_url"] + "/chat/completions", timeout=10,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


def test_the_gateways_model_serves_every_name_asked_and_a_rollouts_own_wins(traced, engine):
    with BackgroundGateway([engine.url], model="policy") as gw:
        plain = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 1}).json()
        own = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 2, "model": "other"}).json()
        assert _call(plain, "claude-opus-5-5").json()["model"] == "policy"  # the engine was asked for the policy
        assert _call(plain, "policy").json()["model"] == "policy"
        assert _call(own, "gpt-5").json()["model"] == "other"
        for opened in (plain, own):
            assert httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={}).status_code == 200
    calls = {t.task: t.llm_calls for t in lrl.trajectories(traced)}
    assert [c.model for c in calls[1]] == ["policy", "policy"]
    spans = {s.span_id: s for s in traced.spans(plain["rollout_id"])}
    asked = [spans[c.span_id].attributes.get(semconv.ASKED_MODEL) for c in calls[1]]
    assert asked == ["claude-opus-5-5", None]  # kept only where another name was asked
    assert [c.model for c in calls[2]] == ["other"]


def test_shared_gateways_refuse_a_rollouts_own_model_naming_the_fix(traced, engine):
    with BackgroundGateway([engine.url], shared=True, token="t") as gw:
        r = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 1, "model": "other"},
                       headers={"Authorization": "Bearer t"})
    assert r.status_code == 422 and "--model" in r.json()["error"]["message"]


def test_a_blank_model_is_refused():
    with pytest.raises(ConfigurationError, match="--model"):
        BackgroundGateway(["http://127.0.0.1:1"], model=" ")


def test_a_call_whose_agent_hangs_up_before_the_engine_answers_is_cut_and_recorded_at_once(traced):
    """An agent killed while its call waits for the engine (``lrl.command`` at its timeout): the gateway
    closes the engine's request and records the call as cut then, not when the engine answers."""
    released, closed = asyncio.Event(), []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def stalled(request: Request) -> dict:
        await request.body()
        while not await request.is_disconnected():  # the gateway closing its request is seen here
            await asyncio.sleep(0.05)
        closed.append(time.monotonic())
        released.set()
        return {}

    engine = ServerThread(app, name="stalled")
    engine.start("a stalled engine")
    try:
        with BackgroundGateway([engine.url]) as gw:
            opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 1}).json()
            hung_up = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(opened["base_url"] + "/chat/completions", timeout=0.5,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            deadline = time.monotonic() + 10
            while not closed and time.monotonic() < deadline:
                time.sleep(0.05)
            assert closed and closed[0] - hung_up < 5  # the engine's request was closed, not left to run
            assert httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={}).status_code == 200
    finally:
        engine.stop()
    (traj,) = lrl.trajectories(traced)
    (call,) = traj.llm_calls
    span = {s.span_id: s for s in traced.spans(traj.rollout_id)}[call.span_id]
    assert "hung up" in (span.status_message or "") and span.attributes.get(semconv.INCOMPLETE)
    assert lrl.stats()["gateway_calls_cut_by_client"] >= 1
