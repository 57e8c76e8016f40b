"""Capture never ends silently empty (issue 31): ``OTEL_SDK_DISABLED`` does not switch it off, LLM calls
that bypass the instrumented OpenAI client are recorded or counted at the HTTP layer, a rollout with no
LLM call is counted and marked, and a 400 that is not about the token fields is sent once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import openai
import pytest
import requests

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl import capture

from .vllm_like import VLLMLike

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine():
    with VLLMLike() as e:
        yield e
    capture.takes_token_fields.clear()


def test_otel_sdk_disabled_does_not_switch_capture_off(tmp_path, engine):
    """The variable is set before lightning_rl is imported, as in a production image or CrewAI's docs."""
    script = textwrap.dedent(f"""
        import json, openai
        import lightning_rl as lrl
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        exported = InMemorySpanExporter()
        lrl.configure(store="sqlite:///{tmp_path}/otel.db", span_processors=[SimpleSpanProcessor(exported)])
        client = openai.OpenAI(base_url="{engine.base_url}", api_key="k")

        @lrl.trace
        def agent(q):
            client.chat.completions.create(model="m", messages=[{{"role": "user", "content": q}}])
            return 1.0

        agent("2+2?")
        (t,) = lrl.trajectories(lrl.open_store("sqlite:///{tmp_path}/otel.db"))
        print(json.dumps({{"calls": len(t.llm_calls), "source": t.llm_calls[0].token_ids_source.value,
                           "exported": len(exported.get_finished_spans()), "stats": lrl.stats()}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OTEL_SDK_DISABLED": "true"}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["calls"] == 1 and result["source"] == "engine"  # before: 0 calls, nothing said
    assert result["exported"] == 0  # the user's own export honours their switch ...
    assert result["stats"]["span_processors_not_attached_otel_sdk_disabled"] == 1  # ... and says so
    assert "OTEL_SDK_DISABLED" in out.stderr


def test_a_400_that_is_not_about_the_token_fields_is_sent_once(traced, engine):
    engine.refuse_everything()
    client = openai.OpenAI(base_url=engine.base_url, api_key="k", max_retries=0)
    before = lrl.stats().get("llm_requests_resent_without_token_fields", 0)

    @lrl.trace
    def agent(q):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])

    for q in ("a", "b", "c"):
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            agent(q)
    assert len(engine.requests) == 3  # before: 6 (each resent without its fields)
    assert lrl.stats().get("llm_requests_resent_without_token_fields", 0) == before
    assert [len(t.llm_calls) for t in lrl.trajectories(traced)] == [1, 1, 1]  # each failed call recorded once


CHAT = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}


def test_llm_calls_that_bypass_the_openai_client_are_captured_or_counted(traced, engine):
    """httpx (LiteLLM's hosted_vllm/, the Anthropic client) is taken over: the engine's ids, streamed too, and
    the answer as the caller asked for it; requests is recorded from the exchange; aiohttp is counted."""
    diagnostics.reset()
    url = engine.base_url + "/chat/completions"

    @lrl.trace
    def direct(task):
        plain = httpx.post(url, json=CHAT).json()  # the token fields are added, and taken out of the answer
        assert plain["choices"][0]["message"]["content"] == "42" and "prompt_token_ids" not in plain
        assert plain["choices"][0]["logprobs"] is None and "token_ids" not in plain["choices"][0]
        requests.post(url, json=CHAT, timeout=10)  # requests: recorded as sent (no ids asked for)
        with httpx.stream("POST", url, json={**CHAT, "stream": True}) as streamed:  # a stream, relayed
            text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content", "")
                           for line in streamed.iter_lines() if line.startswith("data: {"))
        assert text == "42"
        message = httpx.post(engine.base_url + "/messages", json={"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "2+2?"}]}).json()  # Anthropic Messages, through chat completions
        assert message["type"] == "message" and message["content"] == [{"type": "text", "text": "42"}]
        httpx.get(engine.url + "/docs")  # not an LLM call: ignored
        return 1.0

    async def with_aiohttp() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.post(url, json=CHAT) as resp:
            await resp.read()

    @lrl.trace
    async def other(task):
        async with httpx.AsyncClient() as client:
            await client.post(url, json=CHAT)
        await with_aiohttp()
        return 1.0

    direct("x")
    asyncio.run(other("y"))
    first, second = lrl.trajectories(traced)
    assert [c.token_ids_source.value for c in first.llm_calls] == ["engine", "missing", "engine", "engine"]
    for call in (first.llm_calls[0], first.llm_calls[2], first.llm_calls[3], second.llm_calls[0]):
        assert call.prompt_token_ids == [11, 12, 13] and call.response_token_ids == [19, 20]
        assert call.response_logprobs == [-0.25, -0.5]
    assert first.llm_calls[2].streamed and first.llm_calls[0].output_messages[0]["content"] == "42"
    assert [c.token_ids_source.value for c in second.llm_calls] == ["engine"]
    assert engine.requests[0]["return_token_ids"] is True and "return_token_ids" not in engine.requests[1]
    stats = lrl.stats()
    assert stats["llm_calls_captured_at_http_layer:httpx"] == 4
    assert stats["llm_calls_bypassing_capture"] == 2  # requests (recorded without ids) and aiohttp (counted)
    assert stats["llm_calls_bypassing_capture:requests"] == 1 and stats["llm_calls_bypassing_capture:aiohttp"] == 1
    samples, _ = lrl.samples(traced)
    assert len(samples) == 4  # the calls with the engine's ids train; the rest is visible, not silent

    client = openai.OpenAI(base_url=engine.base_url, api_key="k")  # the instrumented client: not counted again

    @lrl.trace
    def instrumented(task):
        client.chat.completions.create(**CHAT)
        return 1.0

    instrumented("z")
    assert lrl.stats()["llm_calls_bypassing_capture"] == 2
    assert lrl.stats()["llm_calls_captured_at_http_layer:httpx"] == 4


def test_a_rollout_that_records_no_llm_call_is_counted_and_marked(traced, engine, tmp_path):
    diagnostics.reset()

    @lrl.trace
    def no_model(task):
        return 1.0

    client = openai.OpenAI(base_url=engine.base_url, api_key="k")

    @lrl.trace
    def with_model(task):
        client.chat.completions.create(**CHAT)
        return 1.0

    no_model("a")
    with_model("b")
    assert lrl.stats()["rollouts_without_llm_calls"] == 1
    traced.flush()
    out = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "rollouts", "ls", "--store", traced.path],
                         capture_output=True, text=True, cwd=ROOT)
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    ids = {r.name: r.rollout_id for r in traced.rollouts()}
    assert " 0! " in lines[ids["no_model"]] and " 1 " in lines[ids["with_model"]]
    assert "1 finished rollout(s) marked ! recorded no LLM call" in out.stderr
    listed = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "rollouts", "ls", "--store", traced.path,
                             "--json"], capture_output=True, text=True, cwd=ROOT)
    assert sorted(json.loads(x)["llm_calls"] for x in listed.stdout.splitlines()) == [0, 1]


def test_the_group_judge_asked_inside_an_agent_is_never_the_agents_llm_call(traced, engine):
    """The judge's requests go over plain HTTP with x-lightning-rl-no-capture: not recorded, not counted."""
    from lightning_rl.judge import GroupJudge

    diagnostics.reset()
    judge = GroupJudge(base_url=engine.base_url, model="m", retries=0)

    @lrl.trace
    def agent(task):
        judge.score(task, ["4", "5"])  # the engine answers "42", not scores: the judge fails, as it says
        return 1.0

    agent("2+2?")
    (t,) = lrl.trajectories(traced)
    assert t.llm_calls == [] and lrl.stats().get("llm_calls_bypassing_capture", 0) == 0
    assert engine.app.state.headers[-1]["x-lightning-rl-no-capture"] == "judge"
