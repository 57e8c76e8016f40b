"""How the gateway spreads rollouts over several engines: a rollout sticks to one (its prefix cache),
a new rollout goes to the least busy. Two fake OpenAI-compatible engines that count what they get."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest

import lightning_rl as lrl
from lightning_rl.gateway import BackgroundGateway
from lightning_rl.serving import ServerThread

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402 (module level: the route's annotations are strings)

from ..services import wait_healthy


def fake_engine(name: str, hits: list[str], release: threading.Event | None = None):
    """An engine that answers ``name``; a message starting "slow" is answered after a second, one starting
    "hold" once ``release`` is set (at most a minute)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        text = body["messages"][-1]["content"]
        hits.append(text)
        if text.startswith("slow"):
            await asyncio.sleep(1.0)
        if text.startswith("hold") and release is not None:
            deadline = time.monotonic() + 60
            while not release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
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
    calls = lrl.trajectory(traced, first["rollout_id"]).llm_calls
    assert len(calls) == 5 and all(c.token_ids_source == "engine" for c in calls)


def test_a_rollout_nothing_reaches_for_the_idle_timeout_ends_timed_out_and_a_stop_ends_the_rest(traced):
    """The other rollout is kept open by a call in flight (an open call keeps a rollout from its idle timeout,
    however long it takes), not by calls made often enough: on a loaded machine a gap between two calls
    outlasted the 0.4 s timeout and that rollout timed out too."""
    hits: list[str] = []
    release = threading.Event()
    engine = ServerThread(fake_engine("a", hits, release), name="fake-a")
    engine.start("a fake engine")
    held: threading.Thread | None = None
    try:
        with BackgroundGateway([engine.url], idle_timeout=0.4) as gw:
            def call(opened: dict, text: str = "hi") -> int:
                return httpx.post(opened["base_url"] + "/chat/completions", timeout=70,
                                  json={"model": "m", "messages": [{"role": "user", "content": text}]}).status_code

            quiet = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 1}).json()
            busy = httpx.post(f"{gw.url}/v1/rollouts", json={"task": 2}).json()
            assert call(quiet) == 200 and call(busy) == 200
            def hold() -> None:
                with contextlib.suppress(httpx.HTTPError):  # cut when the gateway stops
                    call(busy, "hold")

            held = threading.Thread(target=hold)
            held.start()
            deadline = time.monotonic() + 60  # a hang guard: the sweep runs every 0.1 s
            while "hold" not in hits:  # busy's call is in flight
                assert time.monotonic() < deadline, "the held call never reached the engine"
                time.sleep(0.01)
            while traced.get_rollout(quiet["rollout_id"]).status == "running":
                assert time.monotonic() < deadline, "the idle rollout was never ended"
                time.sleep(0.05)
            ended = traced.get_rollout(quiet["rollout_id"])
            assert ended.status == "timed_out" and "idle timeout" in ended.error
            assert call(quiet) == 409  # its path answers that it has finished
            assert len(lrl.trajectory(traced, quiet["rollout_id"]).llm_calls) == 1  # what it did stays recorded
            assert traced.get_rollout(busy["rollout_id"]).status == "running"
        # the gateway stopped (its call still open): the rollout it still had open is ended, not left running
        stopped = traced.get_rollout(busy["rollout_id"])
        assert stopped.status == "failed" and "gateway stopped" in stopped.error
        assert len(lrl.trajectory(traced, busy["rollout_id"]).llm_calls) >= 1
    finally:
        release.set()
        if held is not None:
            held.join(70)
        engine.stop()


def test_a_gateway_killed_outright_leaves_no_rollout_running_once_another_starts(traced, tmp_path):
    """kill -9 gives the gateway no graceful stop: its open rollouts (their keys died with it) stay
    "running" in the store until a gateway on the same store starts and finds nothing reached them
    for its idle timeout. Rollouts it holds, or a traced function's own, are left alone."""
    import os
    import signal
    import subprocess
    import sys

    from lightning_rl.records import Rollout
    from lightning_rl.vllm_server import free_port

    hits: list[str] = []
    engine = ServerThread(fake_engine("a", hits), name="fake-a")
    engine.start("a fake engine")
    port = free_port()
    killed = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "gateway", "--upstream", engine.url,
                               "--store", f"sqlite:///{tmp_path / 'traced.db'}", "--port", str(port),
                               "--idle-timeout", "3600"], stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, killed, what="the gateway")
        orphans = [httpx.post(f"{url}/v1/rollouts", json={"task": i}).json() for i in range(2)]
        deadline = time.monotonic() + 30
        assert httpx.post(orphans[0]["base_url"] + "/chat/completions", timeout=10, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        traced.start_rollout(Rollout(rollout_id="traced-own", name="agent", start_time=time.time() - 60))
        while not traced.spans(orphans[0]["rollout_id"]):  # the call's span is committed (the writer's batch)
            assert time.monotonic() < deadline, "the killed gateway never wrote the call"
            time.sleep(0.02)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(10)
        traced.flush()
        assert {traced.get_rollout(o["rollout_id"]).status for o in orphans} == {"running"}

        time.sleep(1.0)  # the orphans' last activity is now more than the next gateway's idle timeout ago
        with BackgroundGateway([engine.url], idle_timeout=0.8) as gw:
            live = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "live"}).json()
            deadline = time.monotonic() + 10
            while any(traced.get_rollout(o["rollout_id"]).status == "running" for o in orphans):
                assert time.monotonic() < deadline, "the killed gateway's rollouts were never ended"
                time.sleep(0.05)
            traced.flush()  # the live rollout's start goes through the writer's queue too
            for o in orphans:
                ended = traced.get_rollout(o["rollout_id"])
                assert ended.status == "timed_out" and "no longer holds it" in ended.error
            assert len(lrl.trajectory(traced, orphans[0]["rollout_id"]).llm_calls) == 1  # its call stays recorded
            assert traced.get_rollout(live["rollout_id"]).status == "running"  # held by this gateway
            assert traced.get_rollout("traced-own").status == "running"  # not a gateway's
    finally:
        if killed.poll() is None:
            killed.kill()
        engine.stop()
