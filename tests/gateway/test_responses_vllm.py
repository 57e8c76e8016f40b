"""The OpenAI Responses API through the gateway, with the real openai client and the real vLLM server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import BackgroundGateway

from ..conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm]
SYSTEM = "You answer arithmetic questions."
GREEDY = dict(temperature=0, max_output_tokens=12)
CALCULATOR = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
              "strict": True, "parameters": {"type": "object", "properties": {"expression": {
                  "type": "string", "pattern": "^[0-9]{1,3}[+][0-9]{1,3}$"}},
                  "required": ["expression"], "additionalProperties": False}}


@pytest.fixture
def rollout(traced, vllm_url):
    with BackgroundGateway([vllm_url]) as gw:
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "responses"}).json()
        yield opened, openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={},
                   headers={"authorization": f"Bearer {opened['api_key']}"})


def test_responses_streamed_and_not_are_recorded_with_the_engines_ids(traced, vllm_url, rollout):
    opened, client = rollout
    plain = client.responses.create(model=SERVED_NAME, instructions=SYSTEM, input="What is 12+30?", **GREEDY)
    assert plain.object == "response" and plain.status in ("completed", "incomplete") and plain.output_text
    with client.responses.stream(model=SERVED_NAME, instructions=SYSTEM, input="What is 12+30?", **GREEDY) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    # a model that reaches max_output_tokens ends with response.incomplete, as OpenAI's API does (the
    # client's get_final_response() wants response.completed): the last event carries the response either way
    assert kinds[-1] == ("response.incomplete" if plain.status == "incomplete" else "response.completed")
    final = events[-1].response
    assert final.status == plain.status and final.output_text == plain.output_text
    direct = openai.OpenAI(base_url=vllm_url, api_key="EMPTY").chat.completions.create(
        model=SERVED_NAME, max_tokens=12, temperature=0, extra_body={"return_token_ids": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12+30?"}])
    traced.flush()
    calls = lrl.trajectory(traced, opened["rollout_id"]).llm_calls
    assert [c.streamed for c in calls] == [False, True]
    for call in calls:
        assert call.token_ids_source == "engine" and call.response_token_ids == direct.choices[0].model_extra["token_ids"]
    assert plain.usage.output_tokens == final.usage.output_tokens == len(calls[0].response_token_ids)


def test_function_calls_and_their_outputs_round_trip(traced, rollout):
    opened, client = rollout
    forced = dict(model=SERVED_NAME, tools=[CALCULATOR], tool_choice={"type": "function", "name": "calculator"},
                  temperature=0, max_output_tokens=80)  # guided decoding: a call whatever the model says
    first = client.responses.create(input="What is 12+30?", **forced)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and set(json.loads(call.arguments)) == {"expression"}
    with client.responses.stream(input="What is 12+30?", **forced) as stream:
        final = stream.get_final_response()
    assert [i.arguments for i in final.output if i.type == "function_call"] == [call.arguments]
    answer = client.responses.create(model=SERVED_NAME, temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "What is 12+30?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
    assert answer.status in ("completed", "incomplete")
    traced.flush()
    traj = lrl.trajectory(traced, opened["rollout_id"])
    (tool,) = traj.tool_spans
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == call.call_id and tool.attributes[semconv.TOOL_RESULT] == "42"


def test_what_chat_completions_cannot_carry_is_refused_with_the_reason(traced, rollout):
    opened, client = rollout
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(model=SERVED_NAME, input="hi", previous_response_id="resp_1", **GREEDY)
    with pytest.raises(openai.BadRequestError, match="'web_search' tool"):
        client.responses.create(model=SERVED_NAME, input="hi", tools=[{"type": "web_search"}], **GREEDY)
    with pytest.raises(openai.BadRequestError, match="'input_image' part"):
        client.responses.create(model=SERVED_NAME, **GREEDY, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    assert lrl.trajectory(traced, opened["rollout_id"]).llm_calls == []  # refused before any engine call
