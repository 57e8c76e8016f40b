"""Issue 57: the gateway parses an engine's whole answer with the garbage collector held off, as the openai client's
path does (``capture.gc_paused``): a 1,000-token answer's log-probs are thousands of dicts, which set off collections
(of the whole heap now and then) while the call is recorded."""

from __future__ import annotations

import gc

import httpx
import pytest

import lightning_rl as lrl
from lightning_rl.capture import CapturedCall
from lightning_rl.gateway import BackgroundGateway
from lightning_rl.serving import ServerThread

from ..gc_watch import collections_inside

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402 (module level: the route's annotations are strings)

TOKENS = 1000


def long_engine() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        content = [{"token": "a", "logprob": -i / TOKENS, "bytes": [97], "top_logprobs": []} for i in range(TOKENS)]
        return {"id": "chatcmpl-long", "object": "chat.completion", "created": 0, "model": body["model"],
                "prompt_token_ids": [1, 2, 3],
                "choices": [{"index": 0, "finish_reason": "length", "token_ids": list(range(TOKENS)),
                             "logprobs": {"content": content}, "message": {"role": "assistant", "content": "a" * TOKENS}}]}

    return app


def test_the_gateway_records_a_long_answer_without_setting_off_a_collection(traced, monkeypatch):
    engine = ServerThread(long_engine(), name="fake-long")
    engine.start("a fake engine")
    try:
        with BackgroundGateway([engine.url]) as gw:
            opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 1}).json()
            with collections_inside(monkeypatch, CapturedCall, "record_response") as started_inside:
                r = httpx.post(opened["base_url"] + "/chat/completions", timeout=30,
                               json={"model": "m", "messages": [{"role": "user", "content": "go"}]})
            assert r.status_code == 200, r.text
            assert gc.isenabled()
            httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={})
    finally:
        engine.stop()
    assert started_inside == []
    assert r.json()["choices"][0]["message"]["content"] == "a" * TOKENS
    (call,) = lrl.trajectory(traced, opened["rollout_id"]).llm_calls
    assert call.response_token_ids == list(range(TOKENS))
    assert call.response_logprobs == pytest.approx([-i / TOKENS for i in range(TOKENS)], rel=1e-6)
