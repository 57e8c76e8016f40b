"""OTLP in: spans from an agent's own OpenTelemetry SDK (the real OTLP/HTTP exporter, protobuf, and
OTLP/JSON) become tool and agent spans of the rollout they name; the rest is refused and said."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import BackgroundGateway

DEAD_ENGINE = "http://127.0.0.1:9"  # no LLM call is made here


def _agent_spans(provider: TracerProvider, *, rollout_id: str | None = None) -> None:
    """What an instrumented agent in another process emits: a step, a tool call inside it, and an LLM call."""
    tracer = provider.get_tracer("my-agent")
    extra = {semconv.ROLLOUT_ID: rollout_id} if rollout_id else {}
    with tracer.start_as_current_span("plan", attributes=extra):
        with tracer.start_as_current_span("calculator", attributes={
                semconv.GEN_AI_TOOL_NAME: "calculator", semconv.GEN_AI_TOOL_CALL_ID: "call-1",
                semconv.TOOL_ARGUMENTS: '{"expression": "12+30"}', semconv.TOOL_RESULT: "42", **extra}) as tool:
            tool.add_event("cache miss", {"key": "12+30"})
        tracer.start_span("chat tiny", attributes={semconv.GEN_AI_OPERATION_NAME: "chat", **extra}).end()


def test_spans_from_an_otel_sdk_become_the_rollouts_tool_and_agent_spans(traced):
    with BackgroundGateway([DEAD_ENGINE]) as gw:
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "otlp"}).json()
        exporter = OTLPSpanExporter(endpoint=opened["base_url"] + "/traces",
                                    headers={"authorization": f"Bearer {opened['api_key']}"})
        provider = TracerProvider(resource=Resource.create({"service.name": "node-agent"}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _agent_spans(provider)
        provider.shutdown()
        httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={"reward": 1.0})
    traj = lrl.trajectory(traced, opened["rollout_id"])
    (tool,) = traj.tool_spans
    assert tool.name == "calculator" and tool.attributes[semconv.GEN_AI_OPERATION_NAME] == "execute_tool"
    assert tool.attributes[semconv.TOOL_RESULT] == "42" and tool.attributes["service.name"] == "node-agent"
    assert [e["name"] for e in tool.events] == ["cache miss"]
    spans = {s.name: s for s in traced.spans(opened["rollout_id"])}
    assert spans["plan"].attributes[semconv.GEN_AI_OPERATION_NAME] == "invoke_agent"
    assert tool.parent_id == spans["plan"].span_id  # the agent's own tree, under the rollout's root
    assert spans["plan"].parent_id == spans["invoke_agent gateway"].span_id
    assert "chat tiny" not in spans and traj.llm_calls == []  # calls are the gateway's to record


def test_otlp_json_and_partial_success_for_what_is_refused(traced):
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with BackgroundGateway([DEAD_ENGINE]) as gw:
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "json"}).json()
        _agent_spans(provider, rollout_id=opened["rollout_id"])  # named by attribute: no path, no key
        _agent_spans(provider, rollout_id="not-a-rollout")
        request = encode_spans(memory.get_finished_spans())
        from google.protobuf import json_format

        body = json_format.MessageToDict(request)
        for rs in body["resourceSpans"]:  # OTLP/JSON writes ids as hex
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in span:
                            import base64

                            span[key] = base64.b64decode(span[key]).hex()
        answer = httpx.post(f"{gw.url}/v1/traces", json=body).json()
        assert answer["partialSuccess"]["rejectedSpans"] == "4"  # int64 as a JSON string
        message = answer["partialSuccess"]["errorMessage"]
        assert "3 span(s): no open rollout" in message and "1 span(s): LLM-call spans" in message
        protobuf = httpx.post(f"{gw.url}/v1/traces", content=request.SerializeToString(),
                              headers={"content-type": "application/x-protobuf"})
        parsed = ExportTraceServiceResponse.FromString(protobuf.content)
        assert parsed.partial_success.rejected_spans == 4
        bad = httpx.post(f"{gw.url}/v1/traces", content=b"\x00not protobuf",
                         headers={"content-type": "application/x-protobuf"})
        assert bad.status_code == 400 and "ExportTraceServiceRequest" in bad.json()["error"]["message"]
        other = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "other"}).json()
        foreign = httpx.post(f"{gw.url}/v1/traces", content=request.SerializeToString(),
                             headers={"content-type": "application/x-protobuf",
                                      "authorization": f"Bearer {other['api_key']}"})
        assert "a rollout key writes only its own rollout" in ExportTraceServiceResponse.FromString(
            foreign.content).partial_success.error_message
        for o in (opened, other):
            httpx.post(f"{gw.url}/v1/rollouts/{o['rollout_id']}/finish", json={})
    names = sorted(s.name for s in traced.spans(opened["rollout_id"]))
    assert names == ["calculator", "calculator", "invoke_agent gateway", "plan", "plan"]  # JSON, then protobuf
    assert [s.name for s in traced.spans(other["rollout_id"])] == ["invoke_agent gateway"]


@pytest.mark.parametrize("encoding", ["gzip"])
def test_compressed_bodies(traced, encoding):
    import gzip

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with BackgroundGateway([DEAD_ENGINE]) as gw:
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={}).json()
        _agent_spans(provider)
        body = gzip.compress(encode_spans(memory.get_finished_spans()).SerializeToString())
        r = httpx.post(opened["base_url"] + "/traces", content=body,
                       headers={"content-type": "application/x-protobuf", "content-encoding": encoding})
        assert ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 1  # the chat span
        httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={})
    assert len(lrl.trajectory(traced, opened["rollout_id"]).tool_spans) == 1
