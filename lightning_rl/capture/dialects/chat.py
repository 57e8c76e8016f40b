"""Chat completions, the protocol every dialect is sent to the engine in: what the client did not ask
for is taken out of an answer, a stream is relayed line by line, and an error has OpenAI's shape."""

from __future__ import annotations

from typing import Any

import orjson


def strip(obj: dict[str, Any], injected: tuple[str, ...]) -> dict[str, Any]:
    """An engine's answer (or stream chunk) less the token fields we asked for and the client did not."""
    if not injected:
        return obj
    if "return_token_ids" in injected:
        obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or ():
        if "return_token_ids" in injected:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if "logprobs" in injected and "logprobs" in choice:
            choice["logprobs"] = None
    return obj


def error(status: int, message: str, details: list[str] | None = None) -> dict[str, Any]:
    """An error in OpenAI's shape, so that an agent's OpenAI client shows the reason."""
    return {"error": {"message": message, "type": "lightning_rl_gateway", "code": status, "details": details or []}}


class ChatRenderer:
    """A stream relayed as the engine sent it, less the token fields the client did not ask for."""

    passthrough = True

    def chunk(self, data: dict[str, Any], injected: tuple[str, ...]) -> bytes:
        return b"data: " + orjson.dumps(strip(data, injected)) + b"\n\n"

    def done(self) -> bytes:
        return b"data: [DONE]\n\n"


def relay_line(raw: bytes, call: Any, render: Any) -> tuple[bytes, bool]:
    """One line of an engine's SSE stream: given to ``call`` (a ``CapturedCall``) and rendered for the
    client. Returns ``(bytes to send, whether it was the stream's end)``."""
    line = raw.rstrip(b"\r")
    payload = line[5:].strip() if line.startswith(b"data:") else None
    if payload == b"[DONE]":
        return render.done(), True
    data = None
    if payload:
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            pass
    if data is not None:
        call.on_chunk(data)
        return render.chunk(data, call.injected), False
    if line and render.passthrough:  # comments, events, anything else the engine sent
        return line + b"\n\n", False
    return b"", False
