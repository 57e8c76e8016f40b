"""OTLP/HTTP trace requests in (protobuf or JSON), decoded with the ``opentelemetry-proto`` package.

``decode`` turns an ``ExportTraceServiceRequest`` into plain span dicts (resource attributes under
the span's own); ``encode_answer`` writes the ``ExportTraceServiceResponse``, with OTLP's partial
success when spans were refused. OTLP/JSON differs from protobuf's JSON mapping in one place: trace
and span ids are hex strings, not base64; they are converted before parsing.
"""

from __future__ import annotations

import base64
import zlib
from types import SimpleNamespace
from typing import Any

import orjson

from ..boundaries import INT64_MAX, attribute_problems, json_problem
from ..errors import ConfigurationError, OTLPDecodeError, OTLPTooLarge

try:
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                          ExportTraceServiceResponse)
except ImportError as exc:
    raise ConfigurationError(f"OTLP in needs the opentelemetry-proto package ({exc}); install it with: "
                             "pip install opentelemetry-proto (it comes with lightning-rl; or reinstall it)") from None

_KINDS = {0: "INTERNAL", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def content_kind(content_type: str | None) -> str:
    return "json" if content_type and "json" in content_type.lower() else "protobuf"


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return orjson.dumps({kv.key: _value(kv.value) for kv in v.kvlist_value.values}, default=repr).decode()
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: value for kv in kvs if (value := _value(kv.value)) is not None}


def _hex_ids_to_base64(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in ("traceId", "spanId", "parentSpanId")
                    and isinstance(v, str) and v else _hex_ids_to_base64(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_hex_ids_to_base64(x) for x in obj]
    return obj


def inflate(body: bytes, encoding: str | None, limit: int) -> bytes:
    """``body`` decompressed (gzip or deflate), never to more than ``limit`` bytes: the decompressor is
    asked for ``limit + 1`` bytes at most, so a bomb costs ``limit`` bytes of memory, not its full size."""
    if not encoding or encoding.lower() == "identity":
        return body
    name = encoding.lower()
    if name not in ("gzip", "deflate"):
        raise OTLPDecodeError(f"Content-Encoding {encoding!r:.40} is not supported; send gzip, deflate or none")
    # gzip: a gzip header; deflate: HTTP's deflate is zlib-wrapped (wbits 15), some clients send it raw (-15)
    attempts = (31,) if name == "gzip" else (15, -15)
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            if wbits == attempts[-1]:
                raise OTLPDecodeError(f"the body is not valid {encoding} ({exc})") from None
            continue
        if len(out) > limit:
            raise OTLPTooLarge(f"the body decompressed ({encoding}) is over the gateway's limit of {limit} bytes; "
                               "send smaller exports")
        if not inflater.eof:
            raise OTLPDecodeError(f"the body is not valid {encoding} (it ends before its compressed stream does)")
        return out
    raise OTLPDecodeError(f"the body is not valid {encoding}")  # pragma: no cover


def decode(body: bytes, kind: str, encoding: str | None = None, limit: int = 16 * 2**20) -> list[dict[str, Any]]:
    """The spans of an OTLP trace export request (``kind``: ``protobuf`` or ``json``), decompressed to at
    most ``limit`` bytes."""
    body = inflate(body, encoding, limit)
    request = ExportTraceServiceRequest()
    try:
        if kind == "json":
            json_format.ParseDict(_hex_ids_to_base64(orjson.loads(body)), request, ignore_unknown_fields=True)
        else:
            request.ParseFromString(body)
    except (DecodeError, json_format.ParseError, orjson.JSONDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise OTLPDecodeError(f"the body is not an OTLP trace export request ({kind}): {exc}; send "
                              "ExportTraceServiceRequest as application/x-protobuf or application/json") from None
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append({
                    "name": span.name,
                    "ids": (len(span.trace_id), len(span.span_id), len(span.parent_span_id)),
                    "span_id": int.from_bytes(span.span_id, "big") if span.span_id else 0,
                    "parent_id": int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else None,
                    "kind": _KINDS.get(span.kind, "INTERNAL"),
                    "start_ns": span.start_time_unix_nano,
                    "end_ns": span.end_time_unix_nano,
                    "status_code": _STATUS.get(span.status.code, "UNSET"),
                    "status_message": span.status.message or None,
                    "attributes": {**resource, **_attributes(span.attributes)},
                    "events": tuple(SimpleNamespace(name=e.name, timestamp=e.time_unix_nano,
                                                    attributes=_attributes(e.attributes)) for e in span.events),
                })
    return spans


def span_problems(spans: list[dict[str, Any]]) -> list[str]:
    """What in decoded spans could not be stored or read (each named by the span's position and field):
    times beyond 64 bits, ids of the wrong length, attributes of a type the assembly does not read."""
    problems: list[str] = []
    for i, span in enumerate(spans):
        where = f"spans[{i}] ({span['name'][:40]!r})"
        trace_len, span_len, parent_len = span["ids"]
        if span_len != 8 or parent_len not in (0, 8) or trace_len not in (0, 16):
            problems.append(f"{where}: spanId must be 8 bytes, parentSpanId 8 bytes or empty, traceId 16 bytes; "
                            f"got {span_len}, {parent_len} and {trace_len}")
        for field, value in (("startTimeUnixNano", span["start_ns"]), ("endTimeUnixNano", span["end_ns"])):
            if value > INT64_MAX:
                problems.append(f"{where}.{field}: {value} is beyond 2**63-1 ns (the year 2262); send UNIX nanoseconds")
        for j, event in enumerate(span["events"]):
            if event.timestamp > INT64_MAX:
                problems.append(f"{where}.events[{j}].timeUnixNano: {event.timestamp} is beyond 2**63-1 ns")
        problems.extend(f"{where}: {p}" for p in attribute_problems(span["attributes"]))
        problem = json_problem(span["attributes"], f"{where}.attributes")
        if problem:
            problems.append(problem)
        if len(problems) >= 50:
            break
    return problems


def encode_answer(rejected: int, message: str, kind: str) -> bytes:
    answer = ExportTraceServiceResponse()
    if rejected:
        answer.partial_success.rejected_spans = rejected
        answer.partial_success.error_message = message
    if kind == "json":
        return orjson.dumps(json_format.MessageToDict(answer))
    return answer.SerializeToString()
