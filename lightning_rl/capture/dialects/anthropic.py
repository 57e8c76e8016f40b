"""Anthropic Messages (``POST /v1/messages``) through chat completions.

A Messages request becomes a chat-completions request, so that the engine's token ids come with it
and the call is recorded like any other (in-process by the HTTP layer, ``adapters/http_clients.py``,
and by the gateway), and the answer is turned back: a message, or the Messages stream's events
(``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``). What chat completions
cannot say (images, documents, thinking blocks) is refused with a 400 that names the block, never dropped.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from ...errors import TranslationError


_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
_SAMPLING = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("max_tokens", "max_tokens"),
             ("stop_sequences", "stop"), ("stream", "stream"), ("model", "model"))


def _text(content: Any, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TranslationError(f"{where}: content must be a string or a list of blocks, got {type(content).__name__}")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise TranslationError(f"{where}: a {kind!r} block cannot be sent to a chat-completions engine here; "
                                   "send text")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages request as a chat-completions request."""
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise TranslationError("messages must be a non-empty list of {role, content}")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise TranslationError(f"{where}: role must be 'user', 'assistant' or 'system'")
        content = message.get("content")
        if message["role"] == "system":  # a system turn mid-conversation (Claude Code sends them): one in chat too
            messages.append({"role": "system", "content": _text(content, where)})
            continue
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise TranslationError(f"{where}: content must be a string or a list of blocks")
        text: list[str] = []
        tool_calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use" and message["role"] == "assistant":
                tool_calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": orjson.dumps(block.get("input", {})).decode()}})
            elif kind == "tool_result" and message["role"] == "user":
                result = _text(block.get("content", ""), f"{where}.content[{j}]")
                if block.get("is_error"):
                    result = f"Error: {result}"
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            else:
                raise TranslationError(f"{where}.content[{j}]: a {kind!r} block in a {message['role']} message cannot be "
                                       "sent to a chat-completions engine here; send text, tool_use or tool_result")
        if text or tool_calls:
            out: dict[str, Any] = {"role": message["role"], "content": "".join(text)}
            if tool_calls:
                out["tool_calls"] = tool_calls
            messages.append(out)
    chat: dict[str, Any] = {"messages": messages}
    for ours, theirs in _SAMPLING:
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools"):
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description", ""), "parameters": t.get("input_schema", {}),
            **({"strict": t["strict"]} if isinstance(t.get("strict"), bool) else {})}}  # Anthropic's strict tool use
            for t in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or (
            {"type": "function", "function": {"name": choice.get("name")}} if kind == "tool" else None)
        if chat["tool_choice"] is None:
            raise TranslationError(f"tool_choice type {kind!r} is not one of auto, any, tool, none")
    return chat


def _stop_reason(finish: str | None, used_tools: bool) -> str:
    """Messages' stop reason: ``tool_use`` whenever the answer calls a tool (vLLM says ``stop`` for a
    named tool choice), else the chat finish reason's counterpart."""
    if used_tools and finish != "length":
        return "tool_use"
    return _STOP.get(finish, "end_turn")


def _usage(chat: dict[str, Any]) -> dict[str, int]:
    usage = chat.get("usage") or {}
    return {"input_tokens": usage.get("prompt_tokens") or 0, "output_tokens": usage.get("completion_tokens") or 0}


def from_chat(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion as a Messages answer."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        try:
            arguments = orjson.loads(fn.get("arguments") or "{}")
        except orjson.JSONDecodeError:
            arguments = {"_raw": fn.get("arguments")}  # the model wrote arguments that are not JSON: kept as text
        content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": arguments})
    return {"id": "msg_" + (chat.get("id") or uuid.uuid4().hex).replace("chatcmpl-", ""), "type": "message",
            "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(choice.get("finish_reason"), any(b["type"] == "tool_use" for b in content)),
            "stop_sequence": None,
            "usage": _usage(chat)}


def error(status: int, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class StreamRenderer:
    """Chat-completion chunks in, the Messages stream's events out."""

    passthrough = False

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = False
        self.block: tuple[str, int] | None = None  # ("text", -1) or ("tool", tool index), open block
        self.index = -1
        self.finish: str | None = None
        self.used_tools = False
        self.usage: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}

    def _open(self, kind: tuple[str, int], block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + _event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return _event("content_block_stop", {"index": self.index})

    def chunk(self, data: dict[str, Any], injected: tuple[str, ...] = ()) -> bytes:
        out = b""
        if not self.started:
            self.started = True
            out += _event("message_start", {"message": {
                "id": "msg_" + str(data.get("id") or uuid.uuid4().hex).replace("chatcmpl-", ""), "type": "message",
                "role": "assistant", "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}})
        if data.get("usage"):
            self.usage = _usage(data)
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.block != ("text", -1):
                    out += self._open(("text", -1), {"type": "text", "text": ""})
                out += _event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or ():
                key = ("tool", call.get("index", 0))
                self.used_tools = True
                fn = call.get("function") or {}
                if self.block != key:
                    out += self._open(key, {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": {}})
                if fn.get("arguments"):
                    out += _event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}})
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def done(self) -> bytes:
        return self._close() + _event("message_delta", {
            "delta": {"stop_reason": _stop_reason(self.finish, self.used_tools), "stop_sequence": None},
            "usage": {"output_tokens": self.usage["output_tokens"]}}) + _event("message_stop", {})
