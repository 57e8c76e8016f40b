"""Protocols answered through chat completions, one module each, behind one small interface.

A :class:`Dialect` says how its request becomes a chat-completions request (``to_chat``), how the
engine's chat answer becomes its own (``from_chat``; a stream: ``stream(request)`` renders chat chunks
as its events), and how an error is said (``error``). The gateway and the in-process HTTP layer use
the same dialects, so an agent using the Responses API or Anthropic's Messages is recorded with the
engine's token ids either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import anthropic, chat, responses
from ...errors import TranslationError
from ...registry import Registry


@dataclass(frozen=True)
class Dialect:
    name: str
    to_chat: Callable[[dict[str, Any]], dict[str, Any]]
    from_chat: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]  # (chat answer, the request)
    stream: Callable[[dict[str, Any]], Any]  # the request -> a renderer: chunk(data, injected), done()
    error: Callable[[int, str], dict[str, Any]]


MESSAGES = Dialect("anthropic messages", anthropic.to_chat, lambda data, body: anthropic.from_chat(data, body["model"]),
                   lambda body: anthropic.StreamRenderer(body["model"]), anthropic.error)
RESPONSES = Dialect("openai responses", responses.to_chat, responses.from_chat, responses.StreamRenderer,
                    lambda status, message: chat.error(status, message))
#: by the last segment of the endpoint path (``.../v1/messages``); ``DIALECTS.get(segment, None)``: None for a
#: path no dialect answers (chat completions themselves)
DIALECTS: Registry[Dialect] = Registry(
    "capture dialect", of=Dialect,
    hint="add one with lightning_rl.capture.dialects.DIALECTS.add(endpoint, Dialect(...))")
DIALECTS.add("messages", MESSAGES)
DIALECTS.add("responses", RESPONSES)

__all__ = ["DIALECTS", "Dialect", "MESSAGES", "RESPONSES", "TranslationError", "chat"]
