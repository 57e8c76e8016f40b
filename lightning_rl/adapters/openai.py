"""The OpenAI Python client adapter: each chat or text completion it sends inside a rollout is captured.

``instrument()`` (called when lightning_rl is imported) wraps ``SyncAPIClient.request`` and
``AsyncAPIClient.request``, the method every endpoint goes through (plain calls,
``with_raw_response``, ``with_streaming_response``, streaming), so LangChain, AutoGen and plain code
are all seen. Outside a rollout the wrapper only checks a contextvar and calls through.

Inside a rollout, each ``/chat/completions`` or ``/completions`` request becomes a
:class:`~lightning_rl.capture.CapturedCall` (the capture core: the GenAI span, the engine's
``prompt_token_ids``, ``token_ids`` and log-probs): the adapter hands it the server and the request,
sends the fields it adds (``return_token_ids``, ``logprobs``, which servers get them: ``capture/exchange.py``),
and the client's response or stream back to it. A whole answer is read from the engine's bytes before the
client parses them (the HTTP layer hands them to ``CapturedCall.read_answer_bytes``): the client gets it less
the fields only tracing asked for, so it builds no object per log-prob the agent never wanted. Other
endpoints go on to the HTTP layer (``http_clients.py``), which records the Responses API through chat
completions. Nothing here raises
into the caller: failures are logged once per cause and counted.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .. import semconv
from ..diagnostics import report_failure
from ..tracer.context import _rollout
from ..capture import CapturedCall, Server, refused_token_fields, resend_without_token_fields
from .http_clients import instrumented_request


def _endpoint(options: Any) -> str | None:
    if options.method.lower() != "post":
        return None
    url = options.url
    if url.endswith("/chat/completions"):
        return semconv.OP_CHAT
    if url.endswith("/completions"):
        return semconv.OP_TEXT_COMPLETION
    return None


# -- attaching to whatever the client returns ----------------------------------------------------

def _wrap_sync_stream(stream: Any, call: CapturedCall) -> Any:
    inner = stream._iterator

    def iterate():
        try:
            for chunk in inner:
                call.on_chunk(chunk)
                yield chunk
        except GeneratorExit:
            call.finish(incomplete=True)
            raise
        except BaseException as exc:
            call.finish(incomplete=True, error=exc)
            raise
        call.finish()

    call.streamed = True
    stream._iterator = iterate()
    return stream


def _wrap_async_stream(stream: Any, call: CapturedCall) -> Any:
    inner = stream._iterator

    async def iterate():
        try:
            async for chunk in inner:
                call.on_chunk(chunk)
                yield chunk
        except GeneratorExit:
            call.finish(incomplete=True)
            raise
        except BaseException as exc:
            call.finish(incomplete=True, error=exc)
            raise
        call.finish()

    call.streamed = True
    stream._iterator = iterate()
    return stream


_STREAMS: list[type] = []  # openai's Stream and AsyncStream, imported on the first call


def _attach(result: Any, call: CapturedCall) -> Any:
    """Record ``result`` (a response, a stream, or a raw response) into ``call``. Never raises."""
    try:
        if not _STREAMS:
            from openai import AsyncStream, Stream

            _STREAMS[:] = (Stream, AsyncStream)
        if hasattr(result, "choices") and not isinstance(result, (_STREAMS[0], _STREAMS[1])):
            call.record_response(result)  # a parsed completion: the usual case, first
            return result
        if isinstance(result, _STREAMS[0]):
            return _wrap_sync_stream(result, call)
        if isinstance(result, _STREAMS[1]):
            return _wrap_async_stream(result, call)
        parse = getattr(result, "parse", None)
        if callable(parse) and not hasattr(result, "choices"):  # with_raw_response / with_streaming_response
            if inspect.iscoroutinefunction(parse):

                @functools.wraps(parse)
                async def parse_async(*args: Any, **kwargs: Any) -> Any:
                    try:
                        parsed = await parse(*args, **kwargs)
                    except BaseException as exc:
                        call.fail(exc)
                        raise
                    return _attach_parsed(parsed, call)

                result.parse = parse_async
            else:

                @functools.wraps(parse)
                def parse_sync(*args: Any, **kwargs: Any) -> Any:
                    try:
                        parsed = parse(*args, **kwargs)
                    except BaseException as exc:
                        call.fail(exc)
                        raise
                    return _attach_parsed(parsed, call)

                result.parse = parse_sync
            return result
        if hasattr(result, "choices"):
            call.record_response(result)
        else:
            report_failure("unknown LLM response type", message=f"lightning-rl: cannot read an LLM response of type {type(result).__name__}; the call is recorded without a response")
            call.finish(incomplete=True)
    except Exception as exc:
        report_failure("attaching to an LLM response", exc)
        call.finish(incomplete=True)
    return result


def _attach_parsed(parsed: Any, call: CapturedCall) -> Any:
    if call.done or call.streamed:
        return parsed
    return _attach(parsed, call)


_servers: dict[int, tuple[Any, Server]] = {}  # id(base_url) -> (base_url, its Server): read once per client URL


def _server(base_url: Any) -> Server:
    """The server of a client's ``base_url`` (reading an httpx URL's host and port costs microseconds per call)."""
    known = _servers.get(id(base_url))
    if known is not None and known[0] is base_url:  # held here, so its id is not reused while cached
        return known[1]
    server = Server.from_url(base_url)
    if len(_servers) >= 256:
        _servers.clear()
    _servers[id(base_url)] = (base_url, server)
    return server


def _start(client: Any, options: Any) -> tuple[CapturedCall, dict[str, Any]] | None:
    """A captured call for this request (None: not one we record), and the caller's own extra fields."""
    try:
        op = _endpoint(options)
        if op is None:
            return None
        body = options.json_data if isinstance(options.json_data, dict) else {}
        base = dict(options.extra_json) if options.extra_json else {}
        call = CapturedCall(_server(getattr(client, "base_url", None)), {**body, **base} if base else body,
                            op, _rollout.get())
        if call.extra:
            # The client builds these options for this one call (and copies them again before any retry),
            # so setting the field in place is safe and avoids a pydantic copy per call.
            options.extra_json = {**base, **call.extra}
        return call, base
    except Exception as exc:
        report_failure("starting an LLM call span", exc)
        return None


def _wrap_sync(original: Any) -> Any:
    @functools.wraps(original)
    def request(self: Any, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        started = _start(self, options) if _rollout.get() is not None else None
        if started is None:
            return original(self, cast_to, options, *args, **kwargs)
        call, base = started
        mark = instrumented_request.set(call)  # the HTTP layer leaves this request to us, but its bytes
        try:
            try:
                result = original(self, cast_to, options, *args, **kwargs)
            except Exception as exc:
                if not resend_without_token_fields(call, exc):
                    raise
                options.extra_json = {**base, **call.extra} or None
                result = original(self, cast_to, options, *args, **kwargs)
                refused_token_fields(call)
        except BaseException as exc:
            call.fail(exc)
            raise
        finally:
            instrumented_request.reset(mark)
        return _attach(result, call)

    request.__lightning_rl_original__ = original
    return request


def _wrap_async(original: Any) -> Any:
    @functools.wraps(original)
    async def request(self: Any, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        started = _start(self, options) if _rollout.get() is not None else None
        if started is None:
            return await original(self, cast_to, options, *args, **kwargs)
        call, base = started
        mark = instrumented_request.set(call)  # the HTTP layer leaves this request to us, but its bytes
        try:
            try:
                result = await original(self, cast_to, options, *args, **kwargs)
            except Exception as exc:
                if not resend_without_token_fields(call, exc):
                    raise
                options.extra_json = {**base, **call.extra} or None
                result = await original(self, cast_to, options, *args, **kwargs)
                refused_token_fields(call)
        except BaseException as exc:
            call.fail(exc)
            raise
        finally:
            instrumented_request.reset(mark)
        return _attach(result, call)

    request.__lightning_rl_original__ = original
    return request


def instrument() -> bool:
    """Wrap the OpenAI client's request methods (idempotent). Returns False if openai is missing."""
    try:
        from openai._base_client import AsyncAPIClient, SyncAPIClient
    except ImportError:
        return False
    if not hasattr(SyncAPIClient.request, "__lightning_rl_original__"):
        SyncAPIClient.request = _wrap_sync(SyncAPIClient.request)
    if not hasattr(AsyncAPIClient.request, "__lightning_rl_original__"):
        AsyncAPIClient.request = _wrap_async(AsyncAPIClient.request)
    return True


def uninstrument() -> None:
    from openai._base_client import AsyncAPIClient, SyncAPIClient

    for cls in (SyncAPIClient, AsyncAPIClient):
        original = getattr(cls.request, "__lightning_rl_original__", None)
        if original is not None:
            cls.request = original
