"""Anthropic Messages through the gateway, with the real anthropic client and the real vLLM server:
recorded like any call (the engine's token ids), answered in the Messages format, streamed or not."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import BackgroundGateway

from ..conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm]
SYSTEM = "You answer arithmetic questions."
QUESTION = [{"role": "user", "content": "What is 12+30?"}]
GREEDY = {"temperature": 0}  # the anthropic client has no temperature argument: sent in extra_body
CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
              "input_schema": {"type": "object", "properties": {"expression": {
                  "type": "string", "pattern": "^[0-9]{1,3}[+][0-9]{1,3}$"}},
                  "required": ["expression"], "additionalProperties": False}, "strict": True}


@pytest.fixture
def rollout(traced, vllm_url):
    with BackgroundGateway([vllm_url]) as gw:
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "anthropic"}).json()
        client = anthropic.Anthropic(base_url=opened["base_url"].removesuffix("/v1"), api_key=opened["api_key"],
                                     max_retries=0)
        yield gw, opened, client
        httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={},
                   headers={"x-api-key": opened["api_key"]})


def test_messages_streamed_and_not_are_recorded_with_the_engines_ids(traced, vllm_url, rollout):
    gw, opened, client = rollout
    message = client.messages.create(model=SERVED_NAME, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                     messages=QUESTION)
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=SERVED_NAME, max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                messages=QUESTION) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == message.content[0].text
    direct = openai.OpenAI(base_url=vllm_url, api_key="EMPTY").chat.completions.create(
        model=SERVED_NAME, max_tokens=12, temperature=0, extra_body={"return_token_ids": True},
        messages=[{"role": "system", "content": SYSTEM}, *QUESTION])
    traced.flush()
    traj = lrl.trajectory(traced, opened["rollout_id"])
    assert [c.streamed for c in traj.llm_calls] == [False, True]
    for call in traj.llm_calls:
        assert call.token_ids_source == "engine" and call.input_messages[0] == {"role": "system", "content": SYSTEM}
        assert call.response_token_ids == direct.choices[0].model_extra["token_ids"]
        assert call.output_messages[0]["content"] == message.content[0].text
    assert message.usage.output_tokens == final.usage.output_tokens == len(traj.llm_calls[0].response_token_ids)


def test_tool_use_and_tool_results_round_trip(traced, rollout):
    gw, opened, client = rollout
    forced = dict(model=SERVED_NAME, max_tokens=200, extra_body=GREEDY, tools=[CALCULATOR],
                  tool_choice={"type": "tool", "name": "calculator"})  # guided decoding: a call, whatever the model
    first = client.messages.create(messages=QUESTION, **forced)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "calculator" and set(use.input) == {"expression"} and first.stop_reason == "tool_use"
    with client.messages.stream(messages=QUESTION, **forced) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]  # input_json_delta assembled
    answer = client.messages.create(model=SERVED_NAME, max_tokens=8, extra_body=GREEDY, messages=[
        *QUESTION, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}])
    assert answer.content[0].type == "text"
    traced.flush()
    traj = lrl.trajectory(traced, opened["rollout_id"])
    assert [c.tool_calls[0].name for c in traj.llm_calls[:2]] == ["calculator", "calculator"]
    (tool,) = traj.tool_spans
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == use.id and tool.attributes[semconv.TOOL_RESULT] == "42"


def test_what_chat_completions_cannot_carry_is_refused_in_anthropics_shape(traced, rollout):
    gw, opened, client = rollout
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="'image' block"):
        client.messages.create(model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError, match="the engine answered 404"):
        client.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    stranger = anthropic.Anthropic(base_url=gw.url, api_key="lrl-made-up", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError, match="unknown rollout key"):
        stranger.messages.create(model=SERVED_NAME, max_tokens=4, messages=QUESTION)
    by_key = anthropic.Anthropic(base_url=gw.url, api_key=opened["api_key"], max_retries=0)  # the key alone
    assert by_key.messages.create(model=SERVED_NAME, max_tokens=4, extra_body=GREEDY, messages=QUESTION).content
