"""LLM calls made without the instrumented OpenAI client, captured at the HTTP layer.

``httpx`` and ``httpx2`` (what LiteLLM, the OpenAI client's ``/responses`` and Anthropic's client use),
``requests`` and ``aiohttp`` are wrapped where every request passes (``Client.send``,
``Session.send``, ``ClientSession._request``); outside a rollout, and for the requests the openai
adapter records itself (it marks them), the wrapper only reads a context variable and calls through.
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
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import EngineRefusal, TranslationError
from .. import semconv
from ..diagnostics import count, report_failure
from ..tracer.context import _rollout
from ..capture import CapturedCall, Server, refused_token_fields, resend_without_token_fields
from ..capture.dialects import DIALECTS, MESSAGES, Dialect
from ..capture.dialects.chat import ChatRenderer, relay_line, strip

#: Set by the openai adapter around the OpenAI client's requests that it records itself.
instrumented_request: ContextVar[bool] = ContextVar("lightning_rl_instrumented_request", default=False)

_PATHS = (("/chat/completions", semconv.OP_CHAT), ("/completions", semconv.OP_TEXT_COMPLETION),
          ("/responses", "responses"), ("/messages", "messages"))
_DROPPED_HEADERS = frozenset({"content-length", "content-encoding", "transfer-encoding"})


def endpoint_of(method: Any, path: Any) -> str | None:
    """The LLM operation a request is, by its method and URL path (None: not an LLM call)."""
    if isinstance(method, bytes):
        method = method.decode()
    if not isinstance(method, str) or method.upper() != "POST":
        return None
    path = path.decode() if isinstance(path, bytes) else str(path)
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, op in _PATHS:
        if path.endswith(suffix):
            return op
    return None


def _not_ours(headers: Any) -> bool:
    try:
        return headers is not None and semconv.NO_CAPTURE_HEADER in {str(k).lower() for k in headers.keys()}
    except Exception:
        return False


def _fix(library: str, op: str, recorded: bool) -> str:
    if op == "messages":
        what = "Anthropic Messages to a hosted API (or not through httpx) is not recorded in-process, only counted"
    elif op == "responses":
        what = "the Responses API to a hosted API (or not through httpx) is not recorded in-process, only counted"
    elif recorded:
        what = (f"{library} called the server directly; the call is recorded from the HTTP exchange, with the "
                "engine's token ids only if the request asked for return_token_ids itself")
    else:
        what = f"{library} called the server directly and streamed (or cannot be read here): only counted"
    return (f"lightning-rl: an LLM request inside a rollout ({op}) bypassed capture: {what} "
            "(llm_calls_bypassing_capture). To train on these calls, send them through the gateway (lrl.command, "
            "or `lightning-rl gateway` with the client's base URL set to the rollout's), or through httpx or the "
            "openai client to your engine. Logged once per library, endpoint and kind")


def seen(library: str, method: Any, url: Any, path: Any, body: Any, *, recordable: bool,
         headers: Any = None) -> Any:
    """Note an LLM request capture cannot take over; returns a ``CapturedCall`` to finish when it can be
    recorded from the exchange (``done``), else None."""
    state = _rollout.get()
    if state is None or instrumented_request.get() or _not_ours(headers):
        return None
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
        return CapturedCall(Server.from_url(url), request, op, state, json=True, inject=False)
    except Exception as exc:
        report_failure("recording a bypassing LLM call", exc)
        return None


def done(call: Any, status: int, content: Any) -> None:
    """Finish a call recorded from the exchange (``content``: the answer's JSON bytes)."""
    if call is None:
        return
    try:
        if status != 200:
            call.finish(error=EngineRefusal(status, bytes(content or b"").decode(errors="replace")))
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


# -- httpx and httpx2: the exchange taken over, with the engine's ids ----------------------------------------
@dataclass
class _Exchange:
    """An LLM request sent to the engine as chat completions (or as it was), and how to answer it."""

    module: Any  # httpx or httpx2
    original: Any  # the caller's request
    call: CapturedCall
    dialect: Dialect | None
    body: dict[str, Any]  # the caller's request body
    chat: dict[str, Any]  # what goes to the engine, before the call's extra fields
    url: Any
    stream: bool

    def request(self) -> Any:
        headers = [(k, v) for k, v in self.original.headers.multi_items() if k.lower() not in _DROPPED_HEADERS]
        if self.dialect is MESSAGES and "authorization" not in self.original.headers:
            key = self.original.headers.get("x-api-key")
            if key:  # Anthropic's clients send the key there; an OpenAI-compatible engine reads a bearer
                headers.append(("authorization", f"Bearer {key}"))
        content = orjson.dumps({**self.chat, **self.call.extra} if self.call.extra else self.chat)
        return self.module.Request("POST", self.url, headers=headers, content=content,
                                   extensions=self.original.extensions)

    def answer(self, status: int, data: Any) -> Any:
        return self.module.Response(status, headers=[("content-type", "application/json")],
                                    content=orjson.dumps(data), request=self.original)

    def refusal(self, status: int, text: str) -> Any:
        """The engine's refusal as the caller's protocol says it (a chat request: the engine's own words)."""
        self.call.finish(error=EngineRefusal(status, text))
        if self.dialect is None:
            return self.module.Response(status, headers=[("content-type", "application/json")], content=text.encode(),
                                        request=self.original)
        try:
            detail = orjson.loads(text)
            detail = detail.get("error", detail) if isinstance(detail, dict) else detail
            message = detail.get("message") if isinstance(detail, dict) else str(detail)
        except orjson.JSONDecodeError:
            message = text[:2000]
        return self.answer(status, self.dialect.error(status, f"the engine answered {status}: {message}"))

    def whole(self, data: dict[str, Any]) -> Any:
        self.call.record_response(data)
        if self.dialect is not None:
            return self.answer(200, self.dialect.from_chat(data, self.body))
        return self.answer(200, strip(data, self.call.injected))

    def renderer(self) -> Any:
        self.call.streamed = True
        return self.dialect.stream(self.body) if self.dialect is not None else ChatRenderer()


def _take_over(module: Any, library: str, request: Any) -> Any:
    """An ``_Exchange`` for an LLM request that goes to an engine through httpx/httpx2; a Response to give
    the caller at once (a dialect's 400); or None (not ours: the request goes on as it is)."""
    state = _rollout.get()
    if state is None or instrumented_request.get() or _not_ours(request.headers):
        return None
    op = endpoint_of(request.method, request.url.path)
    if op is None:
        return None
    server = Server.from_url(request.url)
    if server.hosted:
        return None  # a hosted API: recorded without ids, or counted (seen)
    try:
        body = orjson.loads(request.content)
    except Exception:  # a body not read yet, or not JSON: counted as it goes
        return None
    if not isinstance(body, dict):
        return None
    dialect = DIALECTS.get(op, None)
    chat, url = body, request.url
    if dialect is not None:
        try:
            chat = dialect.to_chat(body)
        except TranslationError as exc:
            count("llm_requests_refused_by_dialect")
            return module.Response(400, headers=[("content-type", "application/json")],
                                   content=orjson.dumps(dialect.error(400, str(exc))), request=request)
        chat["model"] = body.get("model")
        if chat.get("stream"):
            chat["stream_options"] = {"include_usage": True}  # the usage the final events carry
        path = request.url.path.rstrip("/")
        url = request.url.copy_with(path=path[:path.rfind("/")] + "/chat/completions")
        op = semconv.OP_CHAT
    try:
        call = CapturedCall(server, chat, op, state, json=True)
    except Exception as exc:
        report_failure("capturing an LLM call at the HTTP layer", exc)
        return None
    count(f"llm_calls_captured_at_http_layer:{library}")
    return _Exchange(module, request, call, dialect, body, chat, url, bool(chat.get("stream")))


def _lines(chunks: Any) -> Any:
    pending = b""
    for received in chunks:
        *lines, pending = (pending + received).split(b"\n")
        yield from lines
    if pending:
        yield pending


def _send_exchange(original: Any, client: Any, ex: _Exchange, args: tuple, kwargs: dict[str, Any]) -> Any:
    send_kwargs = {**kwargs, "stream": True}
    while True:
        response = original(client, ex.request(), *args, **send_kwargs)
        if response.status_code == 200:
            break
        text = response.read().decode(errors="replace")
        response.close()
        if resend_without_token_fields(ex.call, EngineRefusal(response.status_code, text)):
            refused_token_fields(ex.call)
            continue
        return ex.refusal(response.status_code, text)
    if not ex.stream:
        try:
            data = orjson.loads(response.read())
        finally:
            response.close()
        return ex.whole(data)
    render = ex.renderer()

    def relayed() -> Any:
        finished = False
        try:
            for line in _lines(response.iter_bytes()):
                piece, end = relay_line(line, ex.call, render)
                finished = finished or end
                if piece:
                    yield piece
        finally:
            response.close()
            ex.call.finish(incomplete=not finished)

    answer = ex.module.Response(200, headers=[("content-type", "text/event-stream")], content=relayed(),
                                request=ex.original)
    if not kwargs.get("stream"):
        answer.read()
    return answer


async def _send_exchange_async(original: Any, client: Any, ex: _Exchange, args: tuple, kwargs: dict[str, Any]) -> Any:
    send_kwargs = {**kwargs, "stream": True}
    while True:
        response = await original(client, ex.request(), *args, **send_kwargs)
        if response.status_code == 200:
            break
        text = (await response.aread()).decode(errors="replace")
        await response.aclose()
        if resend_without_token_fields(ex.call, EngineRefusal(response.status_code, text)):
            refused_token_fields(ex.call)
            continue
        return ex.refusal(response.status_code, text)
    if not ex.stream:
        try:
            data = orjson.loads(await response.aread())
        finally:
            await response.aclose()
        return ex.whole(data)
    render = ex.renderer()

    async def relayed() -> Any:
        finished, pending = False, b""
        try:
            async for received in response.aiter_bytes():
                *lines, pending = (pending + received).split(b"\n")
                for line in lines:
                    piece, end = relay_line(line, ex.call, render)
                    finished = finished or end
                    if piece:
                        yield piece
            if pending:
                piece, end = relay_line(pending, ex.call, render)
                finished = finished or end
                if piece:
                    yield piece
        finally:
            await response.aclose()
            ex.call.finish(incomplete=not finished)

    answer = ex.module.Response(200, headers=[("content-type", "text/event-stream")], content=relayed(),
                                request=ex.original)
    if not kwargs.get("stream"):
        await answer.aread()
    return answer


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


def _wrap_send(original: Any, library: str, read: Any, module: Any = None) -> Any:
    """``send(request, ...)`` of httpx, httpx2 (``module``: taken over when it goes to an engine) or a
    requests ``Session`` (recorded from the exchange or counted), watched inside a rollout."""

    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None or instrumented_request.get():
            return original(self, request, *args, **kwargs)
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
        if _rollout.get() is None or instrumented_request.get():
            return await original(self, request, *args, **kwargs)
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
