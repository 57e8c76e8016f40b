"""LLM calls made without the instrumented OpenAI client, captured at the HTTP layer.

``httpx`` and ``httpx2`` (what LiteLLM, the OpenAI client's ``/responses`` and Anthropic's client use),
``requests`` and ``aiohttp`` are wrapped where every request passes (``Client.send``,
``Session.send``, ``ClientSession._request``); outside a rollout the wrapper only reads a context variable
and calls through. The requests the openai adapter records itself (it marks them with their call) go
through as they are, and a whole answer's bytes are handed to that call to read before the client parses
them (``_read_whole_answer``).
A request carrying ``x-lightning-rl-no-capture`` (the group judge's) is left alone.

Inside a rollout, a POST to an OpenAI or Anthropic endpoint path is an LLM call:

* **Through httpx or httpx2, to an engine** (not a hosted API): captured with the engine's token ids,
  as the gateway captures them. A chat or text completion gets ``return_token_ids`` and ``logprobs``
  (``capture/exchange.py`` says which servers) and its answer, whole or streamed, is handed back without them.
  A Responses or Anthropic Messages request is sent to the engine as chat completions through its
  dialect (``dialects/``) and answered in its own format, streamed or not; what the dialect cannot
  carry is answered 400 naming it. Counted per library (``llm_calls_captured_at_http_layer:<library>``).
* **Otherwise** (``requests``, a hosted API, a stream ``requests`` reads itself, ``aiohttp``): a full
  chat or text completion is recorded from the exchange, with the engine's ids only when the request
  asked for them; the rest is counted. Either way counted per library (``llm_calls_bypassing_capture``
  and ``llm_calls_bypassing_capture:<library>``) and logged once with the fix: the gateway, or the
  library's OpenAI-client route.

An engine that speaks HTTP over its own sockets (DSPy 3.4's bundled default engine) is not seen here at
all: its rollouts end with no LLM call, which is counted and logged (``rollouts_without_llm_calls``);
the gateway records those agents. Nothing here raises into the caller, except the 400 a dialect gives
for what it cannot carry.
"""

from __future__ import annotations

import functools
from typing import Any

from ..diagnostics import report_failure
from ..tracer.context import _rollout
from .http_bypass import done, endpoint_of, failed, instrumented_request, seen
from .http_takeover import _Exchange, _send_exchange, _send_exchange_async, _take_over

#: ``endpoint_of``, ``instrumented_request``, ``seen``, ``done`` and ``failed`` (``http_bypass.py``: which requests
#: are LLM calls, and those recorded from the exchange or counted) are imported from here too; the httpx and
#: httpx2 takeover is ``http_takeover.py``.


def _httpx_request(request: Any, kwargs: dict[str, Any]) -> tuple:
    """(method, url, path, body or None when streamed, headers) of an httpx/httpx2 request."""
    body = None if kwargs.get("stream") else request.content
    return request.method, request.url, request.url.path, body, request.headers


def _requests_request(request: Any, kwargs: dict[str, Any]) -> tuple:
    from urllib.parse import urlsplit

    body = None if kwargs.get("stream") else request.body
    return request.method, request.url, urlsplit(request.url).path, body, request.headers


def _note(library: str, read: Any, request: Any, kwargs: dict[str, Any]) -> Any:
    try:
        method, url, path, body, headers = read(request, kwargs)
        return seen(library, method, url, path, body, recordable=body is not None, headers=headers)
    except Exception as exc:  # a request body not read yet (a stream): counted, not recorded
        report_failure("reading a bypassing request", exc)
        return None


def _taken_over(module: Any, library: str, request: Any) -> Any:
    try:
        return _take_over(module, library, request) if module is not None else None
    except Exception as exc:  # never into the caller: the request goes on as it is
        report_failure("capturing an LLM call at the HTTP layer", exc)
        return None


def _read_whole_answer(call: Any, response: Any) -> None:
    """An answer the openai adapter's call waits for, read from the engine's bytes before the client parses
    them (``CapturedCall.read_answer_bytes``); the client gets it less the token fields it did not ask for."""
    try:
        read = getattr(call, "read_answer_bytes", None)
        if read is None or response.status_code != 200 or not hasattr(response, "_content"):
            return
        body = read(response.content)
        if body is not None:
            response._content = body  # httpx keeps a read body there; .content, .text and .json() read it
            if "content-length" in response.headers:
                response.headers["content-length"] = str(len(body))
    except Exception as exc:  # never into the caller: the client reads the answer as it came
        report_failure("reading an LLM answer's bytes", exc)


def _wrap_send(original: Any, library: str, read: Any, module: Any = None) -> Any:
    """``send(request, ...)`` of httpx, httpx2 (``module``: taken over when it goes to an engine) or a
    requests ``Session`` (recorded from the exchange or counted), watched inside a rollout."""

    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None:
            return original(self, request, *args, **kwargs)
        recording = instrumented_request.get()
        if recording:  # the openai adapter's call: it records it, and reads a whole answer's bytes here
            response = original(self, request, *args, **kwargs)
            if module is not None and not kwargs.get("stream"):
                _read_whole_answer(recording, response)
            return response
        exchange = _taken_over(module, library, request)
        if exchange is not None:
            if not isinstance(exchange, _Exchange):
                return exchange  # a dialect's 400
            try:
                return _send_exchange(original, self, exchange, args, kwargs)
            except BaseException as exc:
                exchange.call.finish(error=exc)
                raise
        call = _note(library, read, request, kwargs)
        try:
            response = original(self, request, *args, **kwargs)
        except BaseException as exc:
            failed(call, exc)
            raise
        if call is not None:
            done(call, response.status_code, response.content)
        return response

    send.__lightning_rl_original__ = original
    return send


def _wrap_send_async(original: Any, library: str, read: Any, module: Any = None) -> Any:
    @functools.wraps(original)
    async def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None:
            return await original(self, request, *args, **kwargs)
        recording = instrumented_request.get()
        if recording:  # the openai adapter's call: it records it, and reads a whole answer's bytes here
            response = await original(self, request, *args, **kwargs)
            if module is not None and not kwargs.get("stream"):
                _read_whole_answer(recording, response)
            return response
        exchange = _taken_over(module, library, request)
        if exchange is not None:
            if not isinstance(exchange, _Exchange):
                return exchange
            try:
                return await _send_exchange_async(original, self, exchange, args, kwargs)
            except BaseException as exc:
                exchange.call.finish(error=exc)
                raise
        call = _note(library, read, request, kwargs)
        try:
            response = await original(self, request, *args, **kwargs)
        except BaseException as exc:
            failed(call, exc)
            raise
        if call is not None:
            done(call, response.status_code, response.content)
        return response

    send.__lightning_rl_original__ = original
    return send


def instrument_httpx(module_name: str = "httpx") -> bool:
    """Wrap ``Client.send`` and ``AsyncClient.send`` of httpx (or httpx2) (idempotent)."""
    try:
        module = __import__(module_name)
    except ImportError:
        return False
    for cls, wrap in ((module.Client, _wrap_send), (module.AsyncClient, _wrap_send_async)):
        if not hasattr(cls.send, "__lightning_rl_original__"):
            cls.send = wrap(cls.send, module_name, _httpx_request, module)
    return True


def instrument_httpx2() -> bool:
    return instrument_httpx("httpx2")


def instrument_requests() -> bool:
    try:
        import requests
    except ImportError:
        return False
    if not hasattr(requests.Session.send, "__lightning_rl_original__"):
        requests.Session.send = _wrap_send(requests.Session.send, "requests", _requests_request)
    return True


def instrument_aiohttp() -> bool:
    """aiohttp: counted (a response body read here would be gone for a caller that streams it)."""
    try:
        import aiohttp
    except ImportError:
        return False
    original = aiohttp.ClientSession._request
    if hasattr(original, "__lightning_rl_original__"):
        return True

    @functools.wraps(original)
    async def _request(self: Any, method: Any, str_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is not None and not instrumented_request.get():
            try:
                from yarl import URL

                seen("aiohttp", method, str_or_url, URL(str(str_or_url)).path, None, recordable=False,
                     headers=kwargs.get("headers") or {})
            except Exception as exc:
                report_failure("reading a bypassing request", exc)
        return await original(self, method, str_or_url, *args, **kwargs)

    _request.__lightning_rl_original__ = original
    aiohttp.ClientSession._request = _request
    return True


__all__ = ["endpoint_of", "instrument_aiohttp", "instrument_httpx", "instrument_httpx2", "instrument_requests",
           "instrumented_request"]


from . import module_ready  # noqa: E402  (last: the frameworks imported above, instrumented now)

module_ready(__name__)
