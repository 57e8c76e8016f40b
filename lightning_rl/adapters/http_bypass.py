"""Which HTTP requests are LLM calls (``endpoint_of``), and those capture cannot take over (``requests``, a
hosted API, a stream read by its caller, ``aiohttp``): recorded from the exchange when they can be (``seen``,
then ``done`` or ``failed``), else counted, and logged once with the fix (``http_clients.py`` wraps the
libraries; the module doc there says which requests go where)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import orjson

from ..errors import EngineRefusal
from .. import semconv
from ..diagnostics import count, report_failure
from ..tracer.context import _rollout
from ..capture import CapturedCall, Server

#: Set by the openai adapter around the OpenAI client's requests that it records itself: the request's
#: ``CapturedCall`` (its whole answer is read from the engine's bytes, ``http_clients.py``); False elsewhere.
instrumented_request: ContextVar[Any] = ContextVar("lightning_rl_instrumented_request", default=False)

_PATHS = (("/chat/completions", semconv.OP_CHAT), ("/completions", semconv.OP_TEXT_COMPLETION),
          ("/responses", "responses"), ("/messages", "messages"))


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
