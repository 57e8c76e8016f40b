"""Redaction with a plain OpenAI client against the real vLLM server (issue 36): the secret in the task, a
message and a tool result reaches neither the SQLite store's files nor a user's span processor; names stay;
the token ids of the calls whose text changed are dropped (counted, not trained on) or kept by the setting,
and those of a call the function left unchanged are kept either way."""

from __future__ import annotations

import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.store import trajectory_samples
from lightning_rl.trainer_bridge.batches import set_aside_counts

from ..conftest import SERVED_NAME
from .redactors import CANARY, SECRET, scrub
from .test_redaction import files_holding, redaction, sqlite_in  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vllm
GREEDY = dict(model=SERVED_NAME, max_tokens=4, temperature=0.0, seed=0)


def run_agent(vllm_url: str) -> None:
    client = openai.OpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace(agent="billing")
    def agent(question: str) -> float:
        asked = [{"role": "user", "content": f"My card is {SECRET}. {CANARY}"}]
        first = client.chat.completions.create(messages=asked, **GREEDY)
        with lrl.tool_span("lookup_card", arguments={"card": SECRET}) as tool:
            tool.result = f"card {SECRET} is valid"
        client.chat.completions.create(messages=[
            *asked, {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": f"The lookup said: card {SECRET} is valid"}], **GREEDY)
        client.chat.completions.create(messages=[{"role": "user", "content": f"Say hi. {CANARY}"}], **GREEDY)
        return 1.0

    agent(f"charge {SECRET}")


@pytest.mark.parametrize("listener", [False, True], ids=["store-only", "with-span-processor"])
def test_the_secret_reaches_no_file_and_no_processor_and_redacted_calls_lose_their_ids(redaction, sqlite_in,
                                                                                       vllm_url, listener):
    folder, store = sqlite_in
    exporter = InMemorySpanExporter()
    lrl.configure(store=store, redact=scrub, span_processors=[SimpleSpanProcessor(exporter)] if listener else ())
    run_agent(vllm_url)
    store.flush()
    assert files_holding(folder, SECRET) == [] and files_holding(folder, CANARY) != []
    (t,) = list(lrl.trajectories(store))
    assert t.task == "charge [card]" and t.agents == ["billing"]
    first, second, third = t.llm_calls
    assert first.model == SERVED_NAME and first.agent_name == "billing"
    assert first.input_messages == [{"role": "user", "content": f"My card is [card]. {CANARY}"}]
    assert second.input_messages[-1]["content"] == "The lookup said: card [card] is valid"
    for redacted in (first, second):  # their ids decode to the secret: dropped
        assert redacted.token_ids_source == "missing" and redacted.prompt_token_ids == [] and not redacted.response_logprobs
    assert third.token_ids_source == "engine" and third.prompt_token_ids and len(third.response_logprobs) == len(
        third.response_token_ids)  # the function left its text unchanged: kept
    (tool,) = t.tool_spans
    assert tool.attributes[semconv.GEN_AI_TOOL_NAME] == "lookup_card"
    assert tool.attributes[semconv.TOOL_RESULT] == "card [card] is valid"
    assert lrl.stats()["redacted_token_ids_dropped"] == 2
    assert set_aside_counts()["redacted_token_ids_dropped"] == 2  # on the training metrics line
    samples, stats = trajectory_samples(t, level="call")
    assert len(samples) == 1 and stats.missing_token_ids == 2  # not trained on, and said so
    if listener:
        exported = exporter.get_finished_spans()
        assert len(exported) == 5 and all(SECRET not in s.to_json() for s in exported)
        assert sum(f"[card]. {CANARY}" in s.to_json() for s in exported) == 2  # the first two calls' input


def test_keep_trains_on_the_redacted_calls_but_their_ids_decode_to_the_original(redaction, sqlite_in, vllm_url,
                                                                               tokenizer):
    folder, store = sqlite_in
    lrl.configure(store=store, redact=scrub, redacted_tokens="keep")
    run_agent(vllm_url)
    store.flush()
    (t,) = list(lrl.trajectories(store))
    first = t.llm_calls[0]
    assert first.input_messages[0]["content"] == f"My card is [card]. {CANARY}"
    assert all(c.token_ids_source == "engine" and c.response_token_ids for c in t.llm_calls)
    assert SECRET in tokenizer.decode(first.prompt_token_ids)  # the trade-off "keep" makes
    assert lrl.stats().get("redacted_token_ids_dropped", 0) == 0
    assert len(trajectory_samples(t, level="call")[0]) == 3
