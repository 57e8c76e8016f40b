"""The OpenAI Responses API (``POST /v1/responses``) through chat completions.

Like Anthropic Messages (``anthropic.py``): the request goes to the engine as chat completions, so the
engine's token ids come with it and the call is recorded like any other, and the answer comes back
as a response object, or as the Responses stream's events (``response.created`` ...
``response.completed``). No responses are kept, so ``previous_response_id`` is refused (send the whole
conversation in ``input``), as are items and tools chat completions cannot carry (images, files,
built-in tools such as ``web_search`` and ``local_shell``, ``custom`` tools, reasoning items): a 400 that
names them, never dropped.

Carried: ``instructions``, ``parallel_tool_calls``, ``reasoning.effort`` (as ``reasoning_effort``),
``text.format``, and ``namespace`` tools (Codex's sub-agent tools: each function in it is sent as a
function, and a call to one comes back with its ``namespace``, as OpenAI's API answers). Hints that
change nothing the engine samples are accepted and left out: ``store`` (nothing is kept either way),
``include`` (there is no reasoning to include), ``reasoning.summary``, ``prompt_cache_key`` (the
engine's prefix cache needs no key), ``client_metadata``, ``metadata``, ``text.verbosity``,
``service_tier``, ``truncation``, ``user``, ``safety_identifier``. ``background: true`` is refused.
``tool_choice`` ``auto`` or ``none`` with no tools (Codex's compaction request) is left out: the
same without tools, and vLLM refuses a ``tool_choice`` without tools; ``required`` or a named function
with no tools is refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from ...errors import TranslationError

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TranslationError(f"{where}: content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS:
            raise TranslationError(f"{where}.content[{j}]: an {kind!r} part cannot be sent to a chat-completions "
                                   "engine here; send text")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _functions(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools as chat functions: function tools, and the functions of ``namespace`` tools."""
    functions: list[dict[str, Any]] = []
    for j, tool in enumerate(body.get("tools") or ()):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        inner = tool.get("tools") if kind == "namespace" else [tool]
        if kind not in ("function", "namespace") or not isinstance(inner, list):
            raise TranslationError(f"tools[{j}]: a {kind!r} tool is not served here; give function tools (or a "
                                   "namespace of them)")
        for k, each in enumerate(inner):
            if not isinstance(each, dict) or each.get("type") != "function":
                what = each.get("type") if isinstance(each, dict) else each
                raise TranslationError(f"tools[{j}].tools[{k}]: a {what!r} tool is not served here; give function "
                                       "tools")
            functions.append({key: each[key] for key in ("name", "description", "parameters", "strict")
                              if each.get(key) is not None})
    names = [f.get("name") for f in functions]
    twice = sorted({n for n in names if names.count(n) > 1}, key=str)
    if twice:
        raise TranslationError(f"tools: {twice[0]!r} is named twice (in two namespaces or beside one); chat "
                               "completions names functions without a namespace: give each function its own name")
    return functions


def _namespaces(body: dict[str, Any]) -> dict[str, str]:
    """Each function of a ``namespace`` tool: its namespace (a call to it is answered with it)."""
    return {each["name"]: tool["name"] for tool in body.get("tools") or ()
            if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list)
            for each in tool["tools"] if isinstance(each, dict) and isinstance(each.get("name"), str)}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as a chat-completions request."""
    if body.get("previous_response_id"):
        raise TranslationError("previous_response_id: lightning-rl keeps no responses; send the whole conversation "
                               "in input")
    if body.get("background"):
        raise TranslationError("background: true: lightning-rl keeps no responses to poll; send the request without "
                               "background")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise TranslationError("input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise TranslationError(f"{where}: an item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise TranslationError(f"{where}: role must be user, assistant, system or developer")
            messages.append({"role": role, "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise TranslationError(f"{where}: a {kind!r} item cannot be sent to a chat-completions engine here; send "
                                   "messages, function_call and function_call_output items")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                         ("stream", "stream"), ("seed", "seed")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if isinstance(body.get("parallel_tool_calls"), bool):
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    tools = [{"type": "function", "function": function} for function in _functions(body)]
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None and not tools:  # Codex's compaction request: no tools, tool_choice "auto"
        if choice not in ("auto", "none"):  # auto and none mean the same without tools (vLLM refuses either)
            raise TranslationError(f"tool_choice {choice!r} with no tools: the model cannot call a tool it is not "
                                   "given; send the tools, or tool_choice auto")
    elif isinstance(choice, str):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise TranslationError(f"tool_choice {choice!r} is not auto, none, required or a function")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise TranslationError(f"text.format {fmt.get('type')!r} is not text or json_schema")
    return chat


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    usage = chat.get("usage") or {}
    inp, out = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(item_id: str, call: dict[str, Any], status: str = "completed",
               namespaces: dict[str, str] | None = None) -> dict[str, Any]:
    fn = call.get("function") or {}
    item = {"type": "function_call", "id": item_id, "call_id": call.get("id"), "name": fn.get("name"),
            "arguments": fn.get("arguments") or "", "status": status}
    if namespaces and fn.get("name") in namespaces:
        item["namespace"] = namespaces[fn["name"]]
    return item


def _response(response_id: str, body: dict[str, Any], output: list[dict[str, Any]], finish: str | None,
              usage: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
    truncated = finish == "length"
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "status": status or ("incomplete" if truncated else "completed"),
            "incomplete_details": {"reason": "max_output_tokens"} if truncated and status is None else None,
            "error": None, "model": body.get("model"), "output": output, "instructions": body.get("instructions"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "metadata": body.get("metadata") or {},
            "usage": usage}


def from_chat(chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion as a response object."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output = []
    if message.get("content"):
        output.append(_message_item("msg_" + uuid.uuid4().hex, message["content"]))
    namespaces = _namespaces(body)
    for call in message.get("tool_calls") or ():
        output.append(_call_item("fc_" + uuid.uuid4().hex, call, namespaces=namespaces))
    return _response("resp_" + uuid.uuid4().hex, body, output, choice.get("finish_reason"), _usage(chat))


class StreamRenderer:
    """Chat-completion chunks in, the Responses stream's events out."""

    passthrough = False

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.id = "resp_" + uuid.uuid4().hex
        self.seq = 0
        self.started = False
        self.items: list[dict[str, Any]] = []  # output items, in order, as they are built
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.tool_items: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.namespaces = _namespaces(body)

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        self.seq += 1
        return (b"event: " + kind.encode() + b"\ndata: "
                + orjson.dumps({"type": kind, "sequence_number": self.seq, **data}) + b"\n\n")

    def _close_open(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        index = self.items.index(item)
        if item["type"] == "message":
            text = item.pop("_text")
            done = _message_item(item["id"], text)
            self.items[index] = done
            part = done["content"][0]
            return (self._event("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                              "content_index": 0, "text": text})
                    + self._event("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                                 "content_index": 0, "part": part})
                    + self._event("response.output_item.done", {"output_index": index, "item": done}))
        done = {**item, "status": "completed"}
        self.items[index] = done
        return (self._event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                      "arguments": item["arguments"]})
                + self._event("response.output_item.done", {"output_index": index, "item": done}))

    def chunk(self, data: dict[str, Any], injected: tuple[str, ...] = ()) -> bytes:
        out = b""
        if not self.started:
            self.started = True
            begun = _response(self.id, self.body, [], None, None, status="in_progress")
            out += self._event("response.created", {"response": begun})
            out += self._event("response.in_progress", {"response": begun})
        if data.get("usage"):
            self.usage = _usage(data)
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._close_open()
                    item = {**_message_item("msg_" + uuid.uuid4().hex, "", status="in_progress"), "_text": ""}
                    self.items.append(item)
                    self.open = item
                    index = len(self.items) - 1
                    shown = {k: v for k, v in item.items() if k != "_text"}
                    out += self._event("response.output_item.added", {"output_index": index, "item": shown})
                    out += self._event("response.content_part.added", {
                        "item_id": item["id"], "output_index": index, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}})
                self.open["_text"] += delta["content"]
                out += self._event("response.output_text.delta", {
                    "item_id": self.open["id"], "output_index": self.items.index(self.open), "content_index": 0,
                    "delta": delta["content"]})
            for call in delta.get("tool_calls") or ():
                position = call.get("index", 0)
                fn = call.get("function") or {}
                item = self.tool_items.get(position)
                if item is None:
                    out += self._close_open()
                    item = _call_item("fc_" + uuid.uuid4().hex, {"id": call.get("id"), "function": {
                        "name": fn.get("name"), "arguments": ""}}, status="in_progress", namespaces=self.namespaces)
                    self.tool_items[position] = item
                    self.items.append(item)
                    self.open = item
                    out += self._event("response.output_item.added", {"output_index": len(self.items) - 1,
                                                                      "item": dict(item)})
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    out += self._event("response.function_call_arguments.delta", {
                        "item_id": item["id"], "output_index": self.items.index(item), "delta": fn["arguments"]})
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def done(self) -> bytes:
        out = self._close_open()
        final = _response(self.id, self.body, self.items, self.finish, self.usage)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": final})
