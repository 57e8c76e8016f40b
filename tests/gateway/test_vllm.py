"""The gateway in front of a real vLLM server: unmodified OpenAI clients traced through a rollout's
base URL or key, streamed and not, tool spans from the conversation, rewards, auth and bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import BackgroundGateway
from lightning_rl.records import RolloutStatus
from lightning_rl.tracer import tracing

from ..conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm]

QUESTION = [{"role": "user", "content": "What is 12+30?"}]
GREEDY = dict(temperature=0.0, seed=0, max_tokens=12)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.", "strict": True,
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "pattern": "^[0-9]{1,3}[+][0-9]{1,3}$"}},
                   "required": ["expression"], "additionalProperties": False}}}


@pytest.fixture
def gateway(traced, vllm_url):
    with BackgroundGateway([vllm_url]) as gw:
        yield gw


def _open(gw, **body) -> dict:
    r = httpx.post(f"{gw.url}/v1/rollouts", json={"task": {"q": "12+30"}, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _finish(gw, opened, **body) -> dict:
    r = httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json=body,
                   headers={"authorization": f"Bearer {opened['api_key']}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_unmodified_client_is_traced_through_its_base_url_streamed_and_not(traced, gateway, vllm_url):
    opened = _open(gateway, mode="eval", agent="solver")
    client = openai.OpenAI(base_url=opened["base_url"], api_key="EMPTY", max_retries=0)  # the key is not needed on loopback
    plain = client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
    raw = plain.model_dump()
    assert "prompt_token_ids" not in (plain.model_extra or {}) and plain.choices[0].logprobs is None  # not asked for
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, stream=True, **GREEDY) if c.choices)
    assert streamed == plain.choices[0].message.content
    assert _finish(gateway, opened, status="succeeded", reward=1.0)["status"] == "succeeded"

    direct = openai.OpenAI(base_url=vllm_url, api_key="EMPTY").chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, extra_body={"return_token_ids": True}, logprobs=True, **GREEDY)
    traj = lrl.trajectory(traced, opened["rollout_id"])
    assert traj.status == RolloutStatus.SUCCEEDED and traj.final_reward == 1.0 and traj.mode == "eval"
    assert [c.streamed for c in traj.llm_calls] == [False, True]
    (root,) = [s for s in traced.spans(opened["rollout_id"]) if s.name == "invoke_agent solver"]
    assert root.parent_id is None and all(c.parent_id == root.span_id for c in traj.llm_calls)  # one tree
    for call in traj.llm_calls:  # the engine's own ids, as a direct call asking for them gets them
        assert call.token_ids_source == "engine" and call.agent_name == "solver"
        assert call.prompt_token_ids == direct.model_extra["prompt_token_ids"]
        assert call.response_token_ids == direct.choices[0].model_extra["token_ids"]
        assert call.response_logprobs == pytest.approx([t.logprob for t in direct.choices[0].logprobs.content], abs=1e-4)
        assert call.output_messages[0]["content"] == plain.choices[0].message.content
    assert raw["choices"][0]["message"]["content"] == plain.choices[0].message.content


def test_the_key_alone_routes_calls_and_writes_only_its_own_rollout(traced, gateway):
    first, second = _open(gateway), _open(gateway)
    by_key = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=first["api_key"], max_retries=0)
    by_key.completions.create(model=SERVED_NAME, prompt="12+30=", **GREEDY)  # /v1/completions too
    mixed = openai.OpenAI(base_url=second["base_url"], api_key=first["api_key"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="another rollout"):
        mixed.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
    stranger = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="lrl-made-up", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="unknown rollout key"):
        stranger.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
    _finish(gateway, first)
    _finish(gateway, second, status="failed", error="the agent crashed")
    with pytest.raises(openai.AuthenticationError, match="unknown rollout key"):  # a finished rollout's key is dead
        by_key.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
    assert [c.operation for c in lrl.trajectory(traced, first["rollout_id"]).llm_calls] == ["text_completion"]
    assert lrl.trajectory(traced, second["rollout_id"]).llm_calls == []  # the refused call wrote nothing there
    failed = traced.get_rollout(second["rollout_id"])
    assert failed.status == RolloutStatus.FAILED and failed.error == "the agent crashed"


def test_tool_calls_and_their_results_become_tool_spans_and_rewards_land_on_calls(traced, gateway):
    opened = _open(gateway)
    client = openai.OpenAI(base_url=opened["base_url"].replace("/v1", "/agents/planner/v1"), api_key="EMPTY")
    first = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, tools=[CALCULATOR], max_tokens=80, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "calculator"}})  # forced: guided decoding
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "calculator"
    r = httpx.post(f"{gateway.url}/v1/rollouts/{opened['rollout_id']}/rewards", json={"value": 0.5, "name": "format"})
    assert r.json()["llm_call_index"] == 0
    messages = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    client.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)
    client.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)  # the same result again: one span
    _finish(gateway, opened, reward=1.0)
    traj = lrl.trajectory(traced, opened["rollout_id"])
    assert [c.agent_name for c in traj.llm_calls] == ["planner"] * 3
    assert traj.llm_calls[0].tool_calls[0].name == "calculator"
    (tool,) = traj.tool_spans
    assert tool.attributes[semconv.GEN_AI_TOOL_NAME] == "calculator"
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == call.id
    assert json.loads(tool.attributes[semconv.TOOL_ARGUMENTS]) == json.loads(call.function.arguments)
    assert tool.attributes[semconv.TOOL_RESULT] == "42"
    rewards = {r.name: r for r in traced.rewards(opened["rollout_id"])}
    assert rewards["format"].llm_call_index == 0 and rewards["format"].value == 0.5 and rewards["reward"].value == 1.0
    late = httpx.post(f"{gateway.url}/v1/rollouts/{opened['rollout_id']}/rewards", json={"value": 0.0, "name": "user"})
    assert late.json()["late"] is True
    traced.flush()
    assert {r.name for r in traced.rewards(opened["rollout_id"])} == {"format", "reward", "user"}


def test_an_upstream_that_is_down_is_skipped_and_a_call_none_can_serve_gets_502(traced, vllm_url):
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    with BackgroundGateway([dead, vllm_url]) as gw:
        opened = _open(gw)
        client = openai.OpenAI(base_url=opened["base_url"], api_key="EMPTY", max_retries=0)
        for _ in range(2):
            client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
        health = httpx.get(f"{gw.url}/v1/health").json()
        assert health["upstreams"][dead]["up"] is False
        _finish(gw, opened)
    with BackgroundGateway([dead]) as gw:
        opened = _open(gw)
        client = openai.OpenAI(base_url=opened["base_url"], api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.APIStatusError, match="no upstream engine could serve") as info:
            client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
        assert info.value.status_code == 502
        _finish(gw, opened, status="failed", error="no engine")
    spans = traced.spans(opened["rollout_id"])
    failed_calls = [s for s in spans if s.name.startswith("chat") and s.status_code == "ERROR"]
    assert len(failed_calls) == 1 and "could not be reached" in failed_calls[0].status_message


def test_engine_errors_pass_through_and_bad_requests_are_refused_with_the_reason(traced, vllm_url):
    with BackgroundGateway([vllm_url], max_body_bytes=4096) as gw:
        opened = _open(gw)
        base = opened["base_url"]
        client = openai.OpenAI(base_url=base, api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.NotFoundError):  # the engine's own 404 for a model it does not serve
            client.chat.completions.create(model="no-such-model", messages=QUESTION, **GREEDY)
        assert httpx.post(f"{base}/chat/completions", content=b"{not json").status_code == 400
        too_big = httpx.post(f"{base}/chat/completions", json={"model": SERVED_NAME, "messages": [
            {"role": "user", "content": "x" * 5000}]})
        assert too_big.status_code == 413 and "limit of 4096" in too_big.json()["error"]["message"]
        assert httpx.post(f"{base}/chat/completions", json={"messages": QUESTION}).status_code == 422
        missing = httpx.post(f"{gw.url}/rollouts/nope/v1/chat/completions", json={"model": SERVED_NAME})
        assert missing.status_code == 404 and "unknown rollout 'nope'" in missing.json()["error"]["message"]
        bad_reward = httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/rewards", json={"value": "NaN"})
        assert bad_reward.status_code == 422 and "NaN" in bad_reward.text
        assert httpx.post(f"{gw.url}/v1/rollouts", json={"mode": "nonsense"}).status_code == 422
        _finish(gw, opened)
        again = httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={})
        assert again.status_code == 409 and "has finished" in again.json()["error"]["message"]
    traj = lrl.trajectory(traced, opened["rollout_id"])
    assert len(traj.llm_calls) == 1 and traj.llm_calls[0].token_ids_source == "missing"  # the refused call, recorded


def test_a_token_guards_rollouts_and_a_key_opens_only_its_rollout(traced, vllm_url):
    with BackgroundGateway([vllm_url], token="s3cret") as gw:
        assert httpx.post(f"{gw.url}/v1/rollouts", json={}).status_code == 401
        admin = {"authorization": "Bearer s3cret"}
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={}, headers=admin).json()
        key = {"authorization": f"Bearer {opened['api_key']}"}
        assert httpx.post(f"{gw.url}/v1/rollouts", json={}, headers=key).status_code == 401  # a key opens no rollout
        no_key = httpx.post(f"{opened['base_url']}/chat/completions", json={"model": SERVED_NAME, "messages": QUESTION})
        assert no_key.status_code == 401
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
        client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
        assert httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={}, headers=key).status_code == 200
        late = httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/rewards", json={"value": 1.0}, headers=key)
        assert late.status_code == 401  # late feedback needs the gateway's token
        assert httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/rewards", json={"value": 1.0},
                          headers=admin).json()["late"] is True
    assert len(lrl.trajectory(traced, opened["rollout_id"]).llm_calls) == 1


def test_calls_are_stamped_with_the_published_version(traced, gateway):
    traced.record_policy(SERVED_NAME, 4)
    tracing.reset_policy_versions()
    opened = _open(gateway)
    client = openai.OpenAI(base_url=opened["base_url"], api_key="EMPTY", max_retries=0)
    client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, **GREEDY)
    _finish(gateway, opened)
    assert [c.policy_version for c in lrl.trajectory(traced, opened["rollout_id"]).llm_calls] == [4]


def test_a_client_that_disconnects_mid_stream_leaves_a_recorded_truncated_call(traced, gateway):
    opened = _open(gateway)
    body = {"model": SERVED_NAME, "messages": QUESTION, "stream": True, "max_tokens": 200, "temperature": 1.0,
            "seed": 0, "ignore_eos": True}  # long enough to be cut
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", opened["base_url"] + "/chat/completions", json=body) as response:
            # read up to the first generated token (vLLM's first chunk carries only the role), then hang up;
            # the gateway recorded every chunk it relayed
            lines = response.iter_lines()
            first = next(x for x in lines if x.startswith("data:") and json.loads(x[5:])["choices"][0]["delta"].get("content"))
            assert "token_ids" not in first  # asked for by the gateway, not shown to the client
    # the client is gone; the gateway notices, or the finish closes the call: recorded either way
    _finish(gateway, opened)
    traced.flush()
    (call,) = lrl.trajectory(traced, opened["rollout_id"]).llm_calls
    assert call.streamed and call.incomplete and call.token_ids_source == "engine"
    assert 1 <= len(call.response_token_ids) < 200 and len(call.response_logprobs) == len(call.response_token_ids)
