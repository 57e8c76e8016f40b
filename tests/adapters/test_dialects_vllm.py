"""The Responses API and Anthropic Messages in-process (issue 32): ``client.responses.create`` and
``anthropic.Anthropic(base_url=...).messages.create`` inside ``@trace``, against the real vLLM server, are
sent to the engine as chat completions through their dialect, recorded with the engine's token ids and
log-probs, and answered in their own format, streamed or not. Tool use is forced (a named tool choice:
guided decoding), so nothing depends on what the tiny model says."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics

from ..conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm]
SYSTEM = "You answer arithmetic questions."
QUESTION = "What is 12+30?"
RESPONSES_TOOL = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
                  "strict": True, "parameters": {"type": "object", "properties": {"expression": {
                      "type": "string", "pattern": "^[0-9]{1,3}[+][0-9]{1,3}$"}},
                      "required": ["expression"], "additionalProperties": False}}
ANTHROPIC_TOOL = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                  "input_schema": RESPONSES_TOOL["parameters"], "strict": True}


def _direct_ids(vllm_url: str, max_tokens: int) -> list[int]:
    """What the engine says to the same conversation as a chat completion (greedy): the ids to expect."""
    direct = openai.OpenAI(base_url=vllm_url, api_key="EMPTY").chat.completions.create(
        model=SERVED_NAME, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    return direct.choices[0].model_extra["token_ids"]


def test_the_responses_api_in_process_is_recorded_with_the_engines_ids(traced, vllm_url):
    diagnostics.reset()
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)
    seen = {}

    @lrl.trace
    def agent(task):
        plain = client.responses.create(model=SERVED_NAME, instructions=SYSTEM, input=QUESTION, temperature=0,
                                        max_output_tokens=12)
        with client.responses.stream(model=SERVED_NAME, instructions=SYSTEM, input=QUESTION, temperature=0,
                                     max_output_tokens=12) as stream:
            events = list(stream)
        forced = client.responses.create(model=SERVED_NAME, input=QUESTION, tools=[RESPONSES_TOOL], temperature=0,
                                         tool_choice={"type": "function", "name": "calculator"}, max_output_tokens=200)
        seen.update(plain=plain, events=events, forced=forced)
        return 1.0

    agent("responses")
    plain, events, forced = seen["plain"], seen["events"], seen["forced"]
    assert plain.object == "response" and plain.output_text  # the client's own type, parsed from our answer
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert events[-1].response.output_text == plain.output_text
    (call_item,) = [item for item in forced.output if item.type == "function_call"]
    assert call_item.name == "calculator" and set(json.loads(call_item.arguments)) == {"expression"}
    (traj,) = lrl.trajectories(traced)
    first, second, third = traj.llm_calls
    expected = _direct_ids(vllm_url, 12)
    for call in (first, second):
        assert call.token_ids_source == "engine" and call.response_token_ids == expected
        assert call.response_logprobs is not None and len(call.response_logprobs) == len(expected)
        assert call.input_messages[0] == {"role": "system", "content": SYSTEM}
    assert second.streamed and not first.streamed
    assert third.token_ids_source == "engine" and third.tool_calls[0].name == "calculator"
    assert plain.usage.output_tokens == len(first.response_token_ids)
    assert lrl.stats()["llm_calls_captured_at_http_layer:httpx2"] == 3
    assert lrl.stats().get("llm_calls_bypassing_capture", 0) == 0


def test_anthropic_messages_in_process_are_recorded_with_the_engines_ids(traced, vllm_url):
    diagnostics.reset()
    client = anthropic.Anthropic(base_url=vllm_url.removesuffix("/v1"), api_key="EMPTY", max_retries=0)
    seen = {}

    @lrl.trace
    async def agent(task):
        async_client = anthropic.AsyncAnthropic(base_url=vllm_url.removesuffix("/v1"), api_key="EMPTY", max_retries=0)
        message = await async_client.messages.create(model=SERVED_NAME, max_tokens=12, system=SYSTEM,
                                                     extra_body={"temperature": 0},
                                                     messages=[{"role": "user", "content": QUESTION}])
        with client.messages.stream(model=SERVED_NAME, max_tokens=12, system=SYSTEM, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": QUESTION}]) as stream:
            streamed = "".join(stream.text_stream)
        used = client.messages.create(model=SERVED_NAME, max_tokens=200, extra_body={"temperature": 0},
                                      tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "calculator"},
                                      messages=[{"role": "user", "content": QUESTION}])
        seen.update(message=message, streamed=streamed, used=used)
        return 1.0

    import asyncio

    asyncio.run(agent("anthropic"))
    message, used = seen["message"], seen["used"]
    assert message.type == "message" and seen["streamed"] == message.content[0].text
    (tool_use,) = [b for b in used.content if b.type == "tool_use"]
    assert tool_use.name == "calculator" and set(tool_use.input) == {"expression"} and used.stop_reason == "tool_use"
    (traj,) = lrl.trajectories(traced)
    first, second, third = traj.llm_calls
    expected = _direct_ids(vllm_url, 12)
    assert [c.streamed for c in traj.llm_calls] == [False, True, False]
    for call in (first, second):
        assert call.token_ids_source == "engine" and call.response_token_ids == expected
        assert call.output_messages[0]["content"] == message.content[0].text
    assert third.tool_calls[0].name == "calculator" and third.token_ids_source == "engine"
    assert message.usage.output_tokens == len(first.response_token_ids)


def test_what_a_dialect_cannot_carry_is_refused_naming_it_and_nothing_reaches_the_engine(traced, vllm_url):
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)
    claude = anthropic.Anthropic(base_url=vllm_url.removesuffix("/v1"), api_key="EMPTY", max_retries=0)

    @lrl.trace
    def agent(task):
        with pytest.raises(openai.BadRequestError, match="keeps no responses"):
            client.responses.create(model=SERVED_NAME, input="hi", previous_response_id="resp_1", max_output_tokens=4)
        with pytest.raises(openai.BadRequestError, match="'web_search' tool"):
            client.responses.create(model=SERVED_NAME, input="hi", tools=[{"type": "web_search"}], max_output_tokens=4)
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
        with pytest.raises(anthropic.BadRequestError, match="'image' block"):
            claude.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": [image]}])
        with pytest.raises(anthropic.NotFoundError, match="the engine answered 404"):
            claude.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        return 1.0

    agent("refused")
    (traj,) = lrl.trajectories(traced)
    assert len(traj.llm_calls) == 1 and traj.llm_calls[0].model == "no-such-model"  # only the one that was sent


def test_a_hosted_api_gets_the_request_unchanged_and_it_is_counted(traced, vllm_url, monkeypatch):
    """A host listed as hosted (LIGHTNING_RL_NO_INJECT_HOSTS) gets the Responses request as it is: here vLLM's
    own /v1/responses answers it. Nothing is changed, and the call is counted, not passed off as recorded."""
    from lightning_rl.tracer import tracing

    diagnostics.reset()
    monkeypatch.setattr(tracing.settings, "no_inject_hosts", frozenset({"127.0.0.1"}))
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)

    @lrl.trace
    def agent(task):
        return 1.0 if client.responses.create(model=SERVED_NAME, input="hi", max_output_tokens=4).output else 0.0

    assert agent("hosted") == 1.0
    assert lrl.stats()["llm_calls_bypassing_capture:httpx2"] == 1
