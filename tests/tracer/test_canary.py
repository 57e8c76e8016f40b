"""Canary routing (tracer/canary.py): while the store's latest decision about a served name is a canary,
that share of production rollouts call the candidate's name instead, chosen by rollout id (real HTTP
provider, real SQLite files; the trainer's side is in tests/trainer_bridge/test_canary_vllm.py)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.tracer import tracing
from lightning_rl.tracer.canary import Canary, canaries_from

from ..adapters.strict_provider import StrictProvider


@pytest.fixture
def provider():
    from lightning_rl import capture

    with StrictProvider() as p:
        yield p
    capture.takes_token_fields.clear()


def _canary(store, share=0.5, until=None, name="policy-candidate", version=3):
    store.record_decision("policy", version, "canary", live_version=2, figures={
        "canary_name": name, "canary_share": share, "canary_until": time.time() + 600 if until is None else until})
    tracing.reset_policy_versions()  # read the store now, not at the next refresh


def _ids(route: Canary, routed: bool, n: int = 2) -> list[str]:
    return [rid for rid in (f"r-{i}" for i in range(200)) if route.routes(rid) == routed][:n]


def test_the_share_is_drawn_from_the_rollout_id_and_holds_over_many_rollouts():
    route = Canary("policy", "policy-candidate", 3, 0.1, time.time() + 60)
    ids = [f"rollout-{i}" for i in range(20_000)]
    share = sum(route.routes(rid) for rid in ids) / len(ids)
    assert abs(share - 0.1) < 0.01
    assert [route.routes(rid) for rid in ids[:50]] == [route.routes(rid) for rid in ids[:50]]  # the same every time
    other = Canary("policy", "policy-candidate", 4, 0.1, time.time() + 60)  # the next candidate draws anew
    assert [route.routes(rid) for rid in ids[:500]] != [other.routes(rid) for rid in ids[:500]]


def test_production_calls_of_a_routed_rollout_go_to_the_candidate_and_are_stamped_with_its_version(traced, provider):
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")
    raw = httpx.Client(base_url=provider.base_url)  # the HTTP layer (LiteLLM, plain httpx) routes the same way
    traced.record_policy("policy", 2)

    @lrl.trace(mode="prod")
    def agent(q):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}])
        raw.post("/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": q}]})
        client.chat.completions.create(model="helper", messages=[{"role": "user", "content": q}])  # no canary

    _canary(traced)
    (route,) = canaries_from(traced.latest_decisions()).values()
    routed, kept = _ids(route, True), _ids(route, False)
    for rid in routed + kept:
        with lrl.rollout_overrides(rollout_id=rid):
            agent("q")
    lrl.flush()
    sent = [r["model"] for r in provider.requests if "return_token_ids" not in r]  # this provider refuses them once
    assert sent == ["policy-candidate", "policy-candidate", "helper"] * 2 + ["policy", "policy", "helper"] * 2
    for rid in routed:
        calls = lrl.trajectory(traced, rid).llm_calls
        assert [(c.model, c.policy_version) for c in calls][:2] == [("policy-candidate", 3)] * 2
        assert traced.get_rollout(rid).policy_version == 0  # the helper's call: no version of its own
    for rid in kept:
        assert [(c.model, c.policy_version) for c in lrl.trajectory(traced, rid).llm_calls][:2] == [("policy", 2)] * 2
    assert diagnostics.counters()["llm_calls_routed_to_canary"] == 4

    @lrl.trace(mode="eval")
    def evaluated(q):
        return client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}]).model

    with lrl.rollout_overrides(rollout_id=routed[0]):
        evaluated("q")
    assert provider.requests[-1]["model"] == "policy"  # only production is routed
    raw.close()


@pytest.mark.parametrize("figures, why", [
    ({"canary_until": -1.0}, "expired"),  # a trainer that died mid-canary: routing stops at canary_until
    ({"canary_share": 1.5}, "unreadable"),
    ({"canary_name": "policy"}, "unreadable"),  # the live name itself
])
def test_an_expired_or_unreadable_canary_routes_nothing(traced, provider, figures, why):
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")

    @lrl.trace(mode="prod")
    def agent(q):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}])

    route = Canary("policy", "policy-candidate", 3, 0.5, time.time() + 60)
    _canary(traced, share=figures.get("canary_share", 0.5), until=figures.get("canary_until"),
            name=figures.get("canary_name", "policy-candidate"))
    for rid in _ids(route, True):
        with lrl.rollout_overrides(rollout_id=rid):
            agent("q")
    assert [r["model"] for r in provider.requests if "return_token_ids" not in r] == ["policy", "policy"]
    assert ("canary_decisions_unreadable" in diagnostics.counters()) == (why == "unreadable")
    traced.record_decision("policy", 3, "refused", live_version=2)  # the next decision ends any canary
    tracing.reset_policy_versions()
    assert tracing.canary("prod", "r-1", "policy") is None


def test_the_gateway_routes_its_production_rollouts_as_trace_does(traced):
    pytest.importorskip("fastapi")
    from fastapi import FastAPI, Request

    from lightning_rl.gateway import BackgroundGateway
    from lightning_rl.serving import ServerThread

    asked: dict[str, str] = {}  # the message's text -> the model the engine was asked for
    app = FastAPI()

    async def chat(request: Request) -> dict:
        body = await request.json()
        asked[body["messages"][-1]["content"]] = body["model"]
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "prompt_token_ids": [1, 2], "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [7],
                                                         "logprobs": None, "message": {"role": "assistant",
                                                                                       "content": "ok"}}]}

    chat.__annotations__ = {"request": Request, "return": dict}  # this module's annotations are strings
    app.post("/v1/chat/completions")(chat)
    engine = ServerThread(app, name="fake-engine")
    engine.start("a fake engine")
    traced.record_policy("policy", 2)
    _canary(traced, share=0.5)
    (route,) = canaries_from(traced.latest_decisions()).values()
    try:
        with BackgroundGateway([engine.url]) as gw:
            opened = [httpx.post(f"{gw.url}/v1/rollouts", json={"task": i, "mode": mode}).json()
                      for i, mode in enumerate(["prod"] * 12 + ["train"] * 4)]
            for i, rollout in enumerate(opened):
                r = httpx.post(rollout["base_url"] + "/chat/completions", timeout=10, json={
                    "model": "policy", "messages": [{"role": "user", "content": f"q{i}"}]})
                assert r.status_code == 200, r.text
                httpx.post(f"{gw.url}/v1/rollouts/{rollout['rollout_id']}/finish", json={})
    finally:
        engine.stop()
    expected = {f"q{i}": "policy-candidate" if i < 12 and route.routes(r["rollout_id"]) else "policy"
                for i, r in enumerate(opened)}
    assert asked == expected and 2 <= list(expected.values()).count("policy-candidate") <= 10
    for i, r in enumerate(opened):
        (call,) = lrl.trajectory(traced, r["rollout_id"]).llm_calls
        assert (call.model, call.policy_version) == ((expected[f"q{i}"], 3) if expected[f"q{i}"] != "policy"
                                                     else ("policy", 2))
