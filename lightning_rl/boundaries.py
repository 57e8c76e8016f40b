"""Trust boundaries: the limits a value from outside must fit, checked once where it enters.

Values cross into lightning-rl through HTTP bodies (the store server, the gateway), OTLP, a user's
function arguments and files written by another version. Each is checked where it enters against
what storage can hold, so that one value cannot stop a store (docs/reliability.md, "Trust boundaries"):

* **Integers** stored in a column fit SQLite's signed 64-bit range, ``INT64_MIN .. INT64_MAX``
  (pydantic and orjson take larger ones; SQLite cannot bind them). :data:`Int64` and
  :data:`NonNegativeInt64` carry the range in the records' types.
* **JSON values** stored as text (a task, span attributes and events, a request's messages) nest at
  most :data:`MAX_JSON_DEPTH` levels (orjson writes 254 and a wire op wraps a value in a few more)
  and hold integers in the same range: :func:`json_problem`.
* **Attributes the assembly reads** have the type it reads them as: :data:`ATTRIBUTE_TYPES`,
  :func:`attribute_problems`; chat messages are objects, their tool calls objects with a function
  object: :func:`message_problems`.
* **Credentials** compare as bytes (:func:`secret_matches`): a non-ASCII token is a mismatch, not an error.

A value that fails is refused with a message naming the field and the limit (HTTP: 4xx), or, where
refusing would fail someone's agent (``@trace``), recorded in a safe form (:func:`storable`) and counted.
"""

from __future__ import annotations

import hmac
import reprlib
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from . import semconv
from .errors import ConfigurationError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: The deepest nesting of a stored JSON value (a task, an attribute, a message), in levels.
MAX_JSON_DEPTH = 100
#: Characters kept of a value recorded in its safe form (the repr of a task too deep to store).
SAFE_FORM_CHARS = 1000

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
INT64_TEXT = "SQLite's signed 64-bit range (-2**63 .. 2**63-1)"


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(value: Any, name: str, *, minimum: int = 0, maximum: int = INT64_MAX, optional: bool = False,
              meaning: str = "") -> Any:
    """``value`` when it is an int in ``minimum .. maximum`` (by default up to 2**63-1, what a store column
    holds), or None when ``optional``; otherwise a :class:`ConfigurationError` naming ``name``, the range
    and the value (``meaning`` says what the number is, in the message)."""
    if value is None and optional:
        return None
    if is_int(value) and minimum <= value <= maximum:
        return value
    upper = "2**63-1" if maximum == INT64_MAX else str(maximum)
    what = f" ({meaning})" if meaning else ""
    raise ConfigurationError(f"{name} must be an int >= {minimum} and <= {upper}{what}, got {safe_text(value)}")


def int64_problem(value: Any, field: str) -> str | None:
    """Why ``value`` cannot be stored in an integer column, or None."""
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        return f"{field}: {value} is outside {INT64_TEXT}"
    return None


def _render(path: Any) -> str:
    parts = []
    while isinstance(path, tuple):
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return (path + "".join(reversed(parts)))[:200]


def _flat(value: dict) -> bool:
    """Every key a string and every value a string, float, bool, None or int in range."""
    for key, item in value.items():
        kind = type(item)
        if kind is str or kind is float or kind is bool or item is None:
            continue
        if kind is int and INT64_MIN <= item <= INT64_MAX and type(key) is str:
            continue
        return False
    return all(type(k) is str for k in value)


def json_problem(value: Any, field: str, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``value`` (parsed JSON) cannot be stored as JSON text, or None: nested deeper than
    ``max_depth`` levels, an integer outside 64 bits, or something that is not JSON at all."""
    if type(value) is dict and _flat(value):  # the common case (span attributes): one C-level pass
        return None
    stack: list[tuple[Any, int, Any]] = [(value, 0, field)]  # paths as (parent, key) chains, rendered on error
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, (str, float, bool)) or item is None:
            continue
        if isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                return f"{_render(path)}: {item} is outside {INT64_TEXT}"
            continue
        if isinstance(item, (dict, list, tuple)):
            if depth >= max_depth:
                where = _render(path)
                where = where if len(where) <= 60 else where[:57] + "..."
                return f"{where}: nested deeper than {max_depth} levels; send a flatter value"
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        return f"{_render(path)}: key {safe_text(key)[:40]} is not a string"
                    if not isinstance(child, (str, float, bool)) and child is not None:
                        stack.append((child, depth + 1, (path, key)))
            else:
                stack.extend((child, depth + 1, (path, i)) for i, child in enumerate(item)
                             if not isinstance(child, (str, float, bool)) and child is not None)
            continue
        return f"{_render(path)}: a value of type {type(item).__name__} is not JSON"
    return None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 12, 200, 200
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 50


def safe_text(value: Any) -> str:
    """A bounded description of any value (depth, length): never recurses past a few levels."""
    try:
        text = _REPR.repr(value)
    except Exception as exc:  # a __repr__ that raises
        text = f"<{type(value).__name__}: repr failed: {type(exc).__name__}>"
    return text if len(text) <= SAFE_FORM_CHARS else text[:SAFE_FORM_CHARS - 3] + "..."


def storable(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``value`` in a form every store can hold: integers outside 64 bits become their decimal text,
    what is nested deeper than ``max_depth`` becomes :func:`safe_text` of it, what JSON cannot hold
    becomes its ``repr`` (bounded). Values that are fine are returned as they are."""

    def walk(item: Any, depth: int) -> Any:
        if isinstance(item, (str, float, bool)) or item is None:
            return item
        if isinstance(item, int):
            return item if INT64_MIN <= item <= INT64_MAX else str(item)
        if isinstance(item, (dict, list, tuple)):
            if depth >= max_depth:
                return safe_text(item)
            if isinstance(item, dict):
                return {k if isinstance(k, str) else safe_text(k): walk(v, depth + 1) for k, v in item.items()}
            return [walk(v, depth + 1) for v in item]
        return safe_text(item)

    if json_problem(value, "value", max_depth=max_depth) is None:
        return value
    return walk(value, 0)


#: Attributes the assembly reads, with the type it reads each as (None is always allowed: absent).
ATTRIBUTE_TYPES: dict[str, tuple[type, ...]] = {
    semconv.GEN_AI_OPERATION_NAME: (str,),
    semconv.GEN_AI_REQUEST_MODEL: (str,),
    semconv.GEN_AI_AGENT_NAME: (str,),
    semconv.GEN_AI_TOOL_NAME: (str,),
    semconv.GEN_AI_TOOL_CALL_ID: (str,),
    semconv.GEN_AI_INPUT_MESSAGES: (str,),  # JSON text of a list of message objects
    semconv.GEN_AI_OUTPUT_MESSAGES: (str,),
    semconv.GEN_AI_RESPONSE_FINISH_REASONS: (list, tuple),
    semconv.ROLLOUT_ID: (str,),
    semconv.LLM_CALL_INDEX: (int,),
    semconv.POLICY_VERSION: (int,),
    semconv.POLICY_VERSION_END: (int,),
    semconv.TOKEN_IDS_SOURCE: (str,),
    semconv.SAMPLING_PARAMS: (str,),  # JSON text of an object
    semconv.STREAMED: (bool,),
    semconv.INCOMPLETE: (bool,),
}
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "an array", tuple: "an array"}


def attribute_problems(attributes: Mapping[str, Any], field: str = "attributes") -> list[str]:
    """The attributes the assembly reads whose value has another type than it reads (each named)."""
    problems = []
    for key, types in ATTRIBUTE_TYPES.items():
        value = attributes.get(key)
        if value is None:
            continue
        wrong = not isinstance(value, types) or (bool not in types and isinstance(value, bool))
        if wrong:
            want = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in types))
            problems.append(f"{field}[{key!r}]: must be {want}, got {safe_text(value)[:80]} "
                            f"({type(value).__name__})")
    return problems


def message_problems(messages: Any, field: str = "messages") -> list[str]:
    """Why ``messages`` is not a list of chat messages the assembly can read (each problem named)."""
    if not isinstance(messages, list):
        return [f"{field}: must be a list of message objects, got {type(messages).__name__}"]
    problems = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            problems.append(f"{where}: must be a message object ({{\"role\": ..., \"content\": ...}}), got "
                            f"{type(message).__name__}")
            continue
        for key in ("role", "name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                problems.append(f"{where}.{key}: must be a string, got {type(message[key]).__name__}")
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            problems.append(f"{where}.tool_calls: must be a list of tool call objects")
            continue
        for j, call in enumerate(calls):
            if not isinstance(call, dict):
                problems.append(f"{where}.tool_calls[{j}]: must be a tool call object")
                continue
            function = call.get("function")
            if call.get("id") is not None and not isinstance(call["id"], str):
                problems.append(f"{where}.tool_calls[{j}].id: must be a string, got {type(call['id']).__name__}")
            if not isinstance(function, dict):
                problems.append(f"{where}.tool_calls[{j}].function: must be an object with name and arguments, "
                                f"got {type(function).__name__}")
            elif function.get("name") is not None and not isinstance(function["name"], str):
                problems.append(f"{where}.tool_calls[{j}].function.name: must be a string")
            elif not isinstance(function.get("arguments", ""), (str, dict)):
                problems.append(f"{where}.tool_calls[{j}].function.arguments: must be a JSON string")
        if len(problems) >= 20:
            break
    return problems


def secret_matches(given: str | bytes | None, secret: str) -> bool:
    """Whether a presented credential equals ``secret``, compared as bytes in constant time. A header
    value arrives as bytes (or latin-1 text of them); a query value as text: encoded as UTF-8."""
    if given is None:
        return False
    if isinstance(given, str):
        given = given.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, secret.encode("utf-8", "surrogatepass"))


def header_secret(value: str | None) -> bytes | None:
    """A header value as the bytes that came on the wire (ASGI servers decode headers as latin-1)."""
    if value is None:
        return None
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:  # not from a header after all: compare its UTF-8
        return value.encode("utf-8", "surrogatepass")
