"""How the gateway spreads rollouts over several engines: a rollout sticks to one (its prefix cache),
a new rollout goes to the least busy. Two fake OpenAI-compatible engines that count what they get."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from lightning_rl.gateway import BackgroundGateway
from lightning_rl.store.server import ServerThread

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402 (module level: the route's annotations are strings)


def fake_engine(name: str, hits: list[str]):
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        text = body["messages"][-1]["content"]
        hits.append(text)
        if text.startswith("slow"):
            await asyncio.sleep(1.0)
        return {"id": f"chatcmpl-{name}", "object": "chat.completion", "created": 0, "model": body["model"],
                "prompt_token_ids": [1, 2, 3],
                "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [7], "logprobs": None,
                             "message": {"role": "assistant", "content": name}}]}

    return app


def test_a_rollout_sticks_to_its_engine_and_a_new_one_goes_to_the_least_busy(traced):
    hits = {"a": [], "b": []}
    engines = {n: ServerThread(fake_engine(n, hits[n]), name=f"fake-{n}") for n in hits}
    for e in engines.values():
        e.start("a fake engine")
    try:
        with BackgroundGateway([engines["a"].url, engines["b"].url]) as gw:
            def call(opened: dict, text: str) -> str:
                r = httpx.post(opened["base_url"] + "/chat/completions", timeout=10,
                               json={"model": "m", "messages": [{"role": "user", "content": text}]})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            first = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 1}).json()
            assert call(first, "hello") == "a"  # both idle: the first listed
            slow = threading.Thread(target=call, args=(first, "slow one"))
            slow.start()
            deadline = time.monotonic() + 10
            while len(hits["a"]) < 2:  # the slow call is in flight on engine a
                assert time.monotonic() < deadline
                time.sleep(0.01)
            second = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 2}).json()
            assert call(second, "hi") == "b"  # a is busy: the new rollout goes to b
            slow.join()
            assert [call(second, f"again {i}") for i in range(3)] == ["b"] * 3  # and stays there, a idle or not
            assert [call(first, f"more {i}") for i in range(3)] == ["a"] * 3
            for opened in (first, second):
                httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={})
    finally:
        for e in engines.values():
            e.stop()
    assert hits["a"] == ["hello", "slow one", "more 0", "more 1", "more 2"]
    assert hits["b"] == ["hi", "again 0", "again 1", "again 2"]
    calls = traced.trajectory(first["rollout_id"]).llm_calls
    assert len(calls) == 5 and all(c.token_ids_source == "engine" for c in calls)
