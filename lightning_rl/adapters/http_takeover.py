"""httpx and httpx2 requests to an engine taken over (``http_clients.py`` wraps the libraries): sent as chat
completions with the token fields the capture core adds, through a dialect for the Responses and Anthropic
Messages APIs, and answered in the caller's own format, whole or streamed (``_Exchange``, ``_take_over``,
``_send_exchange`` and its async twin)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import EngineRefusal, TranslationError
from .. import semconv
from ..diagnostics import count, report_failure
from ..tracer.context import _rollout
from ..capture import CapturedCall, Server, gc_paused, refused_token_fields, resend_without_token_fields
from ..capture.dialects import DIALECTS, MESSAGES, Dialect
from ..capture.dialects.chat import ChatRenderer, relay_line, strip
from .http_bypass import _not_ours, endpoint_of, instrumented_request

_DROPPED_HEADERS = frozenset({"content-length", "content-encoding", "transfer-encoding"})


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
            raw = response.read()
        finally:
            response.close()
        with gc_paused():  # a whole answer's thousands of dicts set off no collection (capture/exchange.py)
            return ex.whole(orjson.loads(raw))
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
