"""LLM traffic that does not go through the instrumented OpenAI client: seen at the HTTP layer.

LiteLLM's ``hosted_vllm/`` provider, the Anthropic client, or an agent posting to
``/v1/chat/completions`` with ``httpx`` or ``requests`` itself: before, such a rollout was stored as
succeeded with no LLM call, and nothing said why. An engine that speaks HTTP over its own sockets (DSPy
3.4's bundled default engine) is not seen here at all: its rollouts end with no LLM call, which is
counted and logged (``rollouts_without_llm_calls``); the gateway records those agents. ``httpx``, ``httpx2``, ``requests`` and ``aiohttp``
are wrapped where every request passes (``Client.send``, ``Session.send``, ``ClientSession._request``);
outside a rollout, and for the OpenAI client's own requests (the openai adapter marks them), the
wrapper only reads a context variable and calls through.

Inside a rollout, a POST to an OpenAI or Anthropic endpoint path is an LLM call that capture missed:

* ``/chat/completions`` and ``/completions`` answered in full (not streamed) through httpx, httpx2 or
  requests are **recorded** from the exchange, as the gateway records them: with the engine's token ids
  when the answer carries them (the agent asked for ``return_token_ids``), else marked
  ``token_ids.source = missing`` (kept out of training samples, counted as calls without engine ids);
* anything else (a stream, aiohttp, ``/responses``, Anthropic's ``/messages``) is **counted**.

Either way it is counted per library (``llm_calls_bypassing_capture`` and
``llm_calls_bypassing_capture:<library>``) and logged once per library and endpoint with the fix: send
the agent's calls through the gateway (``lrl.command``, or ``lightning-rl gateway``), or route the
library through the OpenAI client. Nothing here raises into the caller.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any

import orjson

from .. import semconv
from ..diagnostics import count, report_failure
from ..tracer.context import _rollout

#: Set by the openai adapter around the OpenAI client's own requests: those are recorded there.
instrumented_request: ContextVar[bool] = ContextVar("lightning_rl_instrumented_request", default=False)

_PATHS = (("/chat/completions", semconv.OP_CHAT), ("/completions", semconv.OP_TEXT_COMPLETION),
          ("/responses", "responses"), ("/messages", "messages"))
_RECORDED_LIBRARIES = ("httpx", "httpx2", "requests")


def endpoint_of(method: Any, path: Any) -> str | None:
    """The LLM operation a request is, by its method and URL path (None: not an LLM call)."""
    if not isinstance(method, (str, bytes)) or str(method if isinstance(method, str) else method.decode()).upper() != "POST":
        return None
    path = path.decode() if isinstance(path, bytes) else str(path)
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, op in _PATHS:
        if path.endswith(suffix):
            return op
    return None


class _Server:
    """What ``LLMCall`` reads of a client: the server it talks to (its host and port)."""

    def __init__(self, url: Any) -> None:
        from types import SimpleNamespace
        from urllib.parse import urlsplit

        parts = urlsplit(str(url))
        self.base_url = SimpleNamespace(host=parts.hostname, port=parts.port)


class _Options:
    """What ``LLMCall`` reads of a request's options: the body (nothing is added to it here)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.json_data = body
        self.extra_json: dict[str, Any] | None = None


def _fix(library: str, op: str, recorded: bool) -> str:
    if op == "messages":
        what = "the Anthropic Messages API is not recorded in-process, only counted"
    elif op == "responses":
        what = "the OpenAI Responses API is not recorded in-process, only counted"
    elif recorded:
        what = (f"{library} called the engine directly; the call is recorded from the HTTP exchange, with the "
                "engine's token ids only if the request asked for return_token_ids itself")
    else:
        what = f"{library} called the engine directly and streamed (or cannot be read here): only counted"
    return (f"lightning-rl: an LLM request inside a rollout ({op}) bypassed the instrumented OpenAI client: {what} "
            "(llm_calls_bypassing_capture). To train on these calls, send them through the gateway (lrl.command, "
            "or `lightning-rl gateway` with the client's base URL set to the rollout's), or route the library "
            "through the openai client (LiteLLM: the openai/ provider rather than hosted_vllm/). Logged once per "
            "library, endpoint and kind")


def seen(library: str, method: Any, url: Any, path: Any, body: Any, *, recordable: bool,
         headers: Any = None) -> Any:
    """Note an LLM request that capture missed; returns an ``LLMCall`` to finish when it is recorded.
    A request carrying ``semconv.NO_CAPTURE_HEADER`` is not an agent's (the group judge's): left alone."""
    state = _rollout.get()
    if state is None or instrumented_request.get():
        return None
    try:
        if headers is not None and semconv.NO_CAPTURE_HEADER in {str(k).lower() for k in headers.keys()}:
            return None
    except Exception:
        pass
    op = endpoint_of(method, path)
    if op is None:
        return None
    count("llm_calls_bypassing_capture")
    count(f"llm_calls_bypassing_capture:{library}")
    recordable = recordable and op in (semconv.OP_CHAT, semconv.OP_TEXT_COMPLETION)
    report_failure(f"llm call bypassing capture: {library} {op} ({'recorded' if recordable else 'counted'})",
                   message=_fix(library, op, recordable))
    if not recordable:
        return None
    try:
        request = orjson.loads(body) if isinstance(body, (bytes, bytearray, str)) and body else None
        if not isinstance(request, dict):
            return None
        from .openai import LLMCall

        return LLMCall(_Server(url), _Options(request), op, state, json=True, inject=False)
    except Exception as exc:
        report_failure("recording a bypassing LLM call", exc)
        return None


def done(call: Any, status: int, content: Any) -> None:
    """Finish a recorded bypassing call from its answer (``content``: the JSON bytes)."""
    if call is None:
        return
    try:
        if status != 200:
            call.finish(error=RuntimeError(f"the engine answered {status}: {bytes(content or b'')[:500]!r}"))
            return
        data = orjson.loads(content)
        if isinstance(data, dict):
            call.record_response(data)
        else:
            call.finish(incomplete=True)
    except Exception as exc:
        report_failure("recording a bypassing LLM call", exc)
        call.finish(incomplete=True)


def failed(call: Any, exc: BaseException) -> None:
    if call is not None:
        call.finish(error=exc)


# -- the wrappers ----------------------------------------------------------------------------------------
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


def _wrap_send(original: Any, library: str, read: Any) -> Any:
    """``send(request, ...)`` of httpx, httpx2 or a requests ``Session``, watched inside a rollout."""

    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None or instrumented_request.get():
            return original(self, request, *args, **kwargs)
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


def _wrap_send_async(original: Any, library: str, read: Any) -> Any:
    @functools.wraps(original)
    async def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None or instrumented_request.get():
            return await original(self, request, *args, **kwargs)
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
            cls.send = wrap(cls.send, module_name, _httpx_request)
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
