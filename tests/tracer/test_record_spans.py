"""Spans recorded straight to the store when nobody else listens (issue 33), and complete SDK spans for
the user's processors when someone does: the same rows either way."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.diagnostics import counters
from lightning_rl.tracer import tracing
from lightning_rl.tracer.records import RecordSpan


def _handler(request: httpx.Request) -> httpx.Response:
    body = orjson.loads(request.content)
    n = len(body["messages"])
    return httpx.Response(200, json={
        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": "tiny",
        "prompt_token_ids": list(range(10 * n)),
        "usage": {"prompt_tokens": 10 * n, "completion_tokens": 2, "total_tokens": 10 * n + 2},
        "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [5, 6],
                     "message": {"role": "assistant", "content": None, "tool_calls": [
                         {"id": f"call_{n}", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}]},
                     "logprobs": {"content": [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}] * 2}}]})


def _agent(client: openai.OpenAI):
    @lrl.trace(agent="solver")
    def agent(task: str) -> float:
        messages = [{"role": "user", "content": task}]
        with lrl.agent_scope("planner"):
            for _ in range(2):
                answer = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
                messages.append(answer.model_dump(exclude_none=True))
                with lrl.tool_span("add", arguments='{"a":1}') as tool:
                    tool.result = 2
                messages.append({"role": "tool", "tool_call_id": answer.tool_calls[0].id, "content": "2"})
        with lrl.tool_span("broken"):
            raise ValueError("the tool failed")

    return agent


def _run(store) -> list:
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="EMPTY",
                           http_client=httpx.Client(transport=httpx.MockTransport(_handler)))
    with pytest.raises(ValueError, match="the tool failed"):
        _agent(client)("add one")
    rollout = store.rollouts()[-1]
    return store.spans(rollout.rollout_id)


def _shape(spans) -> list:
    """What a stored rollout says apart from ids and clocks: names, kinds, parents (as seq), status,
    attributes (the rollout id masked), events (exception text without its clock), token ids."""
    seq_of = {s.span_id: s.seq for s in spans}
    shape = []
    for s in spans:
        attributes = {k: v for k, v in s.attributes.items() if k != semconv.ROLLOUT_ID}
        events = [(e["name"], e["attributes"]) for e in s.events]
        shape.append((s.seq, s.name, s.kind, seq_of.get(s.parent_id), s.status_code, s.status_message, attributes,
                      events, s.tokens))
    return shape


def test_without_listeners_no_sdk_span_is_made_and_all_is_recorded(traced, monkeypatch):
    made = []
    original = SdkTracer.start_span
    monkeypatch.setattr(SdkTracer, "start_span", lambda self, *a, **kw: made.append(a) or original(self, *a, **kw))
    assert not tracing.listeners
    spans = _run(traced)
    assert made == []
    names = [s.name for s in spans]
    assert names == ["invoke_agent solver", "invoke_agent planner", "chat tiny", "execute_tool add", "chat tiny",
                     "execute_tool add", "execute_tool broken"]
    root, planner, chat, tool = spans[:4]
    assert root.parent_id is None and planner.parent_id == root.span_id and chat.parent_id == planner.span_id
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_1" and tool.attributes[semconv.GEN_AI_AGENT_NAME] == "planner"
    assert {s.trace_id for s in spans} == {root.trace_id} and len({s.span_id for s in spans}) == len(spans)
    assert chat.tokens.prompt_ids == list(range(10)) and chat.tokens.response_logprobs == [-0.25, -0.25]
    assert root.status_code == "ERROR" and root.status_message == "ValueError: the tool failed"
    ((name, attrs),) = [(e["name"], e["attributes"]) for e in spans[-1].events]
    assert name == "exception" and attrs["exception.type"] == "ValueError" and "the tool failed" in attrs["exception.stacktrace"]


def test_user_processors_get_complete_sdk_spans_and_the_store_gets_the_same_rows(traced):
    plain = _shape(_run(traced))
    exporter = InMemorySpanExporter()
    lrl.configure(span_processors=[SimpleSpanProcessor(exporter)])
    assert tracing.listeners == 1
    stored = _run(traced)
    assert _shape(stored) == plain  # the same rows whether or not an SDK span was made
    exported = {format(s.context.span_id, "016x"): s for s in exporter.get_finished_spans()}
    assert set(exported) == {s.span_id for s in stored}
    for s in stored:  # the user's processor sees every span whole: names, parents, attributes, messages, status
        e = exported[s.span_id]
        assert e.name == s.name and dict(e.attributes) == {k: tuple(v) if isinstance(v, list) else v
                                                          for k, v in s.attributes.items()}
        assert (format(e.parent.span_id, "016x") if e.parent else None) == s.parent_id
        assert e.status.status_code.name == s.status_code
    chat = next(e for e in exported.values() if e.name == "chat tiny")
    assert orjson.loads(chat.attributes[semconv.GEN_AI_INPUT_MESSAGES]) == [{"role": "user", "content": "add one"}]


def test_record_spans_parent_across_providers_both_ways(traced):
    user_exporter = InMemorySpanExporter()
    user_provider = TracerProvider()
    user_provider.add_span_processor(SimpleSpanProcessor(user_exporter))
    user_tracer = user_provider.get_tracer("user")

    @lrl.trace
    def agent(x):
        assert isinstance(otel_trace.get_current_span(), RecordSpan)
        with user_tracer.start_as_current_span("user work"), lrl.agent_scope("inner"):
            pass
        return 1.0

    with user_tracer.start_as_current_span("request") as request:
        agent(1)
    spans = traced.spans(traced.rollouts()[0].rollout_id)
    root, inner = spans
    work = next(s for s in user_exporter.get_finished_spans() if s.name == "user work")
    assert root.parent_id == format(request.get_span_context().span_id, "016x")  # ours under the user's
    assert root.trace_id == format(request.get_span_context().trace_id, "032x")
    assert format(work.parent.span_id, "016x") == root.span_id and inner.parent_id == format(work.context.span_id, "016x")


def test_an_attribute_no_span_can_hold_is_dropped_counted_and_the_rest_kept(traced):
    before = counters().get("span_attributes_dropped", 0)

    @lrl.trace
    def agent(x):
        span = otel_trace.get_current_span()
        span.set_attribute("framework.tags", ["a", "b"])
        span.set_attribute("framework.text", type("AgentText", (str,), {})("a str subclass"))  # smolagents' results
        span.set_attribute("framework.config", {"nested": object()})
        span.set_attribute("framework.none", None)
        span.set_attributes({"framework.ok": 1, "framework.mixed": [1, "x"]})
        return 1.0

    agent(1)
    (root,) = traced.spans(traced.rollouts()[0].rollout_id)
    assert root.attributes["framework.tags"] == ["a", "b"] and root.attributes["framework.ok"] == 1
    assert root.attributes["framework.text"] == "a str subclass"
    assert not {"framework.config", "framework.none", "framework.mixed"} & set(root.attributes)
    assert counters()["span_attributes_dropped"] == before + 2


def test_a_forked_process_makes_ids_of_its_own(traced):
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the ids its next span gets
        try:
            span = tracing._records.start_span("child")
            os.write(write, f"{span.get_span_context().trace_id:x} {span.get_span_context().span_id:x}".encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode().split()
    os.waitpid(pid, 0)
    span = tracing._records.start_span("parent")
    assert child != [f"{span.get_span_context().trace_id:x}", f"{span.get_span_context().span_id:x}"]
