"""The openai client's whole answers are read from the engine's bytes (issue 46): the ids and log-probs are
recorded from them, and the client is handed the answer less the token fields only tracing asked for, so
it builds no object per log-prob the agent never wanted. Streams, and what orjson cannot read, are read
from the client's objects as before."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

import lightning_rl as lrl
from lightning_rl.diagnostics import counters

MESSAGES = [{"role": "user", "content": "What is 12+30?"}]
PROMPT_IDS = [151644, 872, 198, 3838, 374]
IDS = [19, 17, 151645]
LOGPROBS = [-0.25, -0.5, -0.125]


def _answer(sent: dict, logprob_text: str | None = None) -> bytes:
    """A chat completion as vLLM writes it for the request ``sent`` (the token fields only when asked)."""
    ids = bool(sent.get("return_token_ids"))
    body = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": sent["model"],
        "prompt_token_ids": PROMPT_IDS if ids else None,
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        "choices": [{
            "index": 0, "finish_reason": "stop", "token_ids": IDS if ids else None,
            "message": {"role": "assistant", "content": "42"},
            "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                     for t, lp in zip(("4", "2", ""), LOGPROBS)]} if sent.get("logprobs") else None,
        }],
    }
    text = json.dumps(body)
    if logprob_text is not None and sent.get("logprobs"):  # what Python's json writes for -inf; orjson refuses it
        text = text.replace("-0.125", logprob_text)
    return text.encode()


class Engine:
    def __init__(self, logprob_text: str | None = None) -> None:
        self.sent: list[dict] = []
        self.logprob_text = logprob_text

    def __call__(self, request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        self.sent.append(sent)
        return httpx.Response(200, content=_answer(sent, self.logprob_text), headers={"content-type": "application/json"})


def _client(engine: Engine, *, asynchronous: bool = False):
    if asynchronous:
        return openai.AsyncOpenAI(base_url="http://engine.local:8000/v1", api_key="EMPTY", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=httpx.MockTransport(engine)))
    return openai.OpenAI(base_url="http://engine.local:8000/v1", api_key="EMPTY", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(engine)))


def _recorded(store):
    (t,) = list(lrl.trajectories(store))
    (call,) = t.llm_calls
    return call


def test_the_client_gets_no_token_field_it_did_not_ask_for_and_the_call_has_them_all(traced):
    engine = Engine()
    client = _client(engine)

    @lrl.trace
    def agent(q):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)

    r = agent("q")
    assert engine.sent[0]["return_token_ids"] is True and engine.sent[0]["logprobs"] is True  # asked by tracing
    assert r.choices[0].logprobs is None
    assert (r.model_extra or {}).get("prompt_token_ids") is None
    assert (r.choices[0].model_extra or {}).get("token_ids") is None
    assert r.choices[0].message.content == "42" and r.usage.total_tokens == 8
    call = _recorded(traced)
    assert call.token_ids_source == "engine"
    assert call.prompt_token_ids == PROMPT_IDS and call.response_token_ids == IDS
    assert call.response_logprobs == LOGPROBS
    assert call.output_messages[0]["content"] == "42"


def test_what_the_agent_asked_for_itself_it_gets(traced):
    engine = Engine()
    client = _client(engine)

    @lrl.trace
    def agent(q):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, logprobs=True)

    r = agent("q")
    assert [c.logprob for c in r.choices[0].logprobs.content] == LOGPROBS  # asked: kept
    assert (r.choices[0].model_extra or {}).get("token_ids") is None  # not asked: taken out
    assert _recorded(traced).response_logprobs == LOGPROBS


def test_a_raw_response_reads_the_same_answer_the_client_parsed(traced):
    client = _client(Engine())

    @lrl.trace
    def agent(q):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=3)
        return raw.http_response, raw.parse()

    http, parsed = agent("q")
    body = http.json()
    assert "prompt_token_ids" not in body and body["choices"][0]["logprobs"] is None
    assert int(http.headers["content-length"]) == len(http.content)
    assert parsed.choices[0].message.content == "42"
    assert _recorded(traced).response_token_ids == IDS


def test_async_client_too(traced):
    client = _client(Engine(), asynchronous=True)

    @lrl.trace
    async def agent(q):
        return await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)

    r = asyncio.run(agent("q"))
    assert r.choices[0].logprobs is None
    call = _recorded(traced)
    assert call.prompt_token_ids == PROMPT_IDS and call.response_logprobs == LOGPROBS


def _long_answer(request: httpx.Request, tokens: int = 1000) -> httpx.Response:
    """vLLM's answer of ``tokens`` tokens with their log-probs: thousands of dicts and lists once parsed."""
    sent = json.loads(request.content)
    content = [{"token": "a", "logprob": -i / tokens, "bytes": [97], "top_logprobs": []} for i in range(tokens)]
    body = {"id": "chatcmpl-2", "object": "chat.completion", "created": 0, "model": sent["model"],
            "prompt_token_ids": PROMPT_IDS, "usage": {"prompt_tokens": 5, "completion_tokens": tokens},
            "choices": [{"index": 0, "finish_reason": "length", "token_ids": list(range(tokens)),
                         "message": {"role": "assistant", "content": "a" * tokens}, "logprobs": {"content": content}}]}
    return httpx.Response(200, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("path", ["openai client", "httpx taken over"])
def test_reading_a_long_answer_sets_off_no_collection_and_leaves_the_collector_as_it_found_it(traced, monkeypatch,
                                                                                               enabled, path):
    """Issue 57: parsing a 1,000-token answer's log-probs makes thousands of dicts; with the collector on, they set
    off collections (of the whole heap now and then: most of what a traced call at 4,000+1,000 added). It is held
    off while the answer is read (and the parsed answer dropped), and left as it was: off stays off."""
    import gc

    from lightning_rl.capture import CapturedCall

    from ..gc_watch import collections_inside

    client = openai.OpenAI(base_url="http://engine.local:8000/v1", api_key="EMPTY", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(_long_answer)))
    # taken over (no openai client): the HTTP layer parses the answer, then records it
    method = "record_response" if path == "httpx taken over" else "read_answer_bytes"
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collections_inside(monkeypatch, CapturedCall, method) as started_inside:
            @lrl.trace
            def agent(q):
                if path == "httpx taken over":
                    return client._client.post("http://engine.local:8000/v1/chat/completions",
                                               json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1000}).json()
                return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1000)

            r = agent("q")
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert started_inside == []
    if path == "httpx taken over":
        assert r["choices"][0]["logprobs"] is None and r["choices"][0]["message"]["content"] == "a" * 1000
    else:
        assert r.choices[0].logprobs is None and r.choices[0].message.content == "a" * 1000
    call = _recorded(traced)
    assert call.response_token_ids == list(range(1000)) and call.prompt_token_ids == PROMPT_IDS
    assert call.response_logprobs == pytest.approx([-i / 1000 for i in range(1000)], rel=1e-6)


def test_an_answer_orjson_cannot_read_is_recorded_from_the_clients_objects(traced):
    """Python's json writes -inf as -Infinity; orjson refuses it, the client's parser takes it."""
    client = _client(Engine(logprob_text="-Infinity"))
    before = counters().get("llm_answers_read_from_client_objects", 0)

    @lrl.trace
    def agent(q):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)

    r = agent("q")
    assert r.choices[0].message.content == "42"
    call = _recorded(traced)
    assert call.token_ids_source == "engine" and call.response_token_ids == IDS
    assert call.response_logprobs[:2] == LOGPROBS[:2] and call.response_logprobs[2] == float("-inf")
    assert counters().get("llm_answers_read_from_client_objects", 0) == before + 1


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_stream_is_read_from_its_chunks_as_before(traced, asynchronous):
    def engine(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] is True
        chunks = [
            {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "tiny", "prompt_token_ids": PROMPT_IDS,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            *({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
               "choices": [{"index": 0, "delta": {"content": t}, "token_ids": [i], "finish_reason": None,
                            "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}]}}]}
              for t, i, lp in zip(("4", "2", ""), IDS, LOGPROBS)),
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    if asynchronous:
        client = openai.AsyncOpenAI(base_url="http://engine.local:8000/v1", api_key="EMPTY", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(engine)))

        @lrl.trace
        async def agent(q):
            stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        text = asyncio.run(agent("q"))
    else:
        client = openai.OpenAI(base_url="http://engine.local:8000/v1", api_key="EMPTY", max_retries=0,
                               http_client=httpx.Client(transport=httpx.MockTransport(engine)))

        @lrl.trace
        def agent(q):
            stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream)

        text = agent("q")
    assert text == "42"
    call = _recorded(traced)
    assert call.prompt_token_ids == PROMPT_IDS and call.response_token_ids == IDS and call.response_logprobs == LOGPROBS
