"""Providers other than vLLM: one that refuses unknown request fields, and the /responses API."""

from __future__ import annotations

import openai
import pytest

import lightning_rl as lrl
from lightning_rl import capture

from .strict_provider import StrictProvider


@pytest.fixture
def provider():
    with StrictProvider() as p:
        yield p
    capture.takes_token_fields.clear()


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_provider_that_refuses_token_fields_still_answers_the_agent(traced, provider, asynchronous):
    before = lrl.stats().get("llm_requests_resent_without_token_fields", 0)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    if asynchronous:
        client = openai.AsyncOpenAI(base_url=provider.base_url, api_key="k")

        @lrl.trace
        async def agent(q):
            r = await client.chat.completions.create(model="hosted", messages=messages, max_tokens=4)
            return 1.0 if r.choices[0].message.content == "42" else 0.0

        rewards = [await agent("q1"), await agent("q2")]
    else:
        client = openai.OpenAI(base_url=provider.base_url, api_key="k")

        @lrl.trace
        def agent(q):
            r = client.chat.completions.create(model="hosted", messages=messages, max_tokens=4)
            return 1.0 if r.choices[0].message.content == "42" else 0.0

        rewards = [agent("q1"), agent("q2")]
    assert rewards == [1.0, 1.0]  # no 400 ever reached the agent
    # first call: refused with our fields, resent without; second call: sent without them at once
    assert ["return_token_ids" in body for body in provider.requests] == [True, False, False]
    assert lrl.stats()["llm_requests_resent_without_token_fields"] - before == 1
    for t in lrl.trajectories(traced):
        (call,) = t.llm_calls
        assert t.status == "succeeded" and call.token_ids_source == "missing"
        assert call.output_messages[0]["content"] == "42"


def test_a_refusal_from_a_server_known_to_take_the_fields_is_not_retried(traced, provider):
    capture.takes_token_fields[f"127.0.0.1:{provider.base_url.split(':')[2].split('/')[0]}"] = True
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")

    @lrl.trace
    def agent(q):
        client.chat.completions.create(model="hosted", messages=[{"role": "user", "content": q}])

    with pytest.raises(openai.BadRequestError):
        agent("q")
    assert len(provider.requests) == 1 and next(lrl.trajectories(traced)).status == "failed"


def test_hosts_listed_in_the_settings_never_get_the_fields(traced, provider, monkeypatch):
    monkeypatch.setattr(lrl.tracer.tracing.settings, "no_inject_hosts", frozenset({"127.0.0.1"}))
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")

    @lrl.trace
    def agent(q):
        return client.chat.completions.create(model="hosted", messages=[{"role": "user", "content": q}])

    agent("q")
    assert len(provider.requests) == 1 and "return_token_ids" not in provider.requests[0]


def test_the_responses_api_to_a_provider_goes_through_the_chat_dialect_and_is_recorded(traced, provider):
    """Issue 32: a Responses call to a server that is not a hosted API is sent as a chat completion (its
    dialect) and recorded; this provider refuses the token fields, so it is recorded without ids."""
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")

    @lrl.trace
    def agent(q):
        return client.responses.create(model="hosted", input=q).output_text

    assert agent("What is 12+30?") == "42"  # the chat answer, in the Responses format
    assert provider.paths == ["/v1/chat/completions", "/v1/chat/completions"]  # refused with the fields, resent
    (t,) = lrl.trajectories(traced)
    (call,) = t.llm_calls
    assert call.token_ids_source == "missing" and call.output_messages[0]["content"] == "42"


def test_the_responses_api_to_a_hosted_api_passes_unchanged_and_is_counted(traced, provider, monkeypatch):
    monkeypatch.setattr(lrl.tracer.tracing.settings, "no_inject_hosts", frozenset({"127.0.0.1"}))
    before = lrl.stats().get("llm_calls_bypassing_capture:httpx2", 0)
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")

    @lrl.trace
    def agent(q):
        return client.responses.create(model="hosted", input=q).output_text

    assert agent("What is 12+30?") == "42"
    assert provider.paths == ["/v1/responses"]
    assert lrl.stats()["llm_calls_bypassing_capture:httpx2"] - before == 1
    (t,) = lrl.trajectories(traced)
    assert t.llm_calls == []


def test_a_trainer_imposes_its_sampling_settings_on_the_agents_requests(traced, provider):
    """verl computes log-probs at its own temperature: the agent's requests are sent at it."""
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")

    @lrl.trace
    def agent(q):
        client.chat.completions.create(model="hosted", messages=[{"role": "user", "content": q}], temperature=1.0)
        return 1.0

    with lrl.rollout_overrides(sampling={"temperature": 0.3, "top_p": 0.9}):
        agent("q")
    agent("q2")  # outside the override: the agent's own settings
    sent = [r for r in provider.requests if "return_token_ids" not in r]
    assert [(r["temperature"], r.get("top_p")) for r in sent] == [(0.3, 0.9), (1.0, None)]
    with pytest.raises(lrl.ConfigurationError, match="sampling"):
        with lrl.rollout_overrides(sampling={"temprature": 0.3}):
            pass
