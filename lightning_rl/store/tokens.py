"""Prefix-shared storage: each LLM call's prompt tokens and input messages are stored as a reference
plus what the call added.

An agent's next prompt almost always starts with its previous prompt + response (the chat history
grows); storing every prompt in full makes a rollout's bytes quadratic in its turns. Both forms of a
prompt are therefore stored as a reference to an earlier LLM span of the same rollout plus a tail:

* tokens: ``prompt_base_seq`` (the span), ``prompt_shared`` (how many tokens of that span's prompt +
  response this prompt starts with) and ``prompt_ids`` (the tokens after them);
* text: ``input_base_seq``, ``input_shared`` (how many characters of that span's conversation, its
  input messages' JSON followed by its output messages, this call's input messages' JSON starts
  with) and ``input_messages`` (the characters after them). The JSON text is rebuilt exactly, so a
  reader gets the very string the tracer recorded.

Readers get whole prompts back (:class:`PromptResolver`). The writer finds each reference from the
sequences it wrote recently (:class:`PrefixSharer`): it needs nothing from the client and trusts no
reference it did not make, so the store server does the same for every client. A store that
restarted, or a rollout evicted from the bounded cache, simply stores its next prompt in full.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..diagnostics import count, report_failure

# Span row columns (after the 13 OTel columns): see rows.SPAN_COLUMNS.
TOKEN_COLUMNS = ("prompt_base_seq", "prompt_shared", "prompt_ids", "response_ids", "response_logprobs")
TEXT_COLUMNS = ("input_base_seq", "input_shared", "input_messages", "output_messages")
_BASE, _SHARED, _PROMPT, _RESPONSE = 13, 14, 15, 16
_IN_BASE, _IN_SHARED, _INPUT, _OUTPUT = 18, 19, 20, 21

#: A token reference is made only for at least this many shared tokens (shorter ones save nothing worth it).
MIN_SHARED_TOKENS = 16
#: A text reference, for at least this many shared characters.
MIN_SHARED_CHARS = 64
#: Candidates kept per rollout (several agents of one rollout interleave their calls).
CANDIDATES_PER_ROLLOUT = 8
#: Bytes of sequences (and, apart, characters of text) the writer keeps to find references in
#: (oldest rollouts are forgotten first).
CACHE_BYTES = 64 * 2**20


def _common_prefix(a: Any, b: Any, unit: int) -> int:
    """How many leading units (4-byte tokens, or characters) ``a`` and ``b`` share (binary search on
    C-level compares of slices)."""
    lo, hi = 0, min(len(a), len(b)) // unit
    if a[:hi * unit] == b[:hi * unit]:
        return hi
    while lo < hi:  # invariant: the first lo units match, the first hi+1 do not all match
        mid = (lo + hi + 1) // 2
        if a[:mid * unit] == b[:mid * unit]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _size(full: Any) -> int:
    """Bytes ``full`` holds in memory, about: a str of non-ASCII text takes up to 4 bytes a character."""
    return len(full) if type(full) is bytes or full.isascii() else 4 * len(full)


def conversation(input_messages: str, output_messages: str | None) -> str:
    """A call's input messages' JSON list followed by its output messages, as one JSON list's text
    (what the next call's input messages usually start with)."""
    if output_messages and output_messages[:1] == "[" and input_messages[-1:] == "]" and len(output_messages) > 2:
        return input_messages[:-1] + ("," if len(input_messages) > 2 else "") + output_messages[1:]
    return input_messages


class _Recent:
    """Per rollout, the last few (seq, full sequence) written, in a bounded cache: where references
    are found. ``unit`` is 4 for packed int32 tokens, 1 for text."""

    def __init__(self, unit: int, minimum: int, limit: int) -> None:
        self._cache: OrderedDict[str, list[tuple[int, Any]]] = OrderedDict()  # rollout -> [(seq, full)]
        self._size = 0
        self._limit = limit
        self._unit = unit
        self._min = minimum
        self._head = minimum * unit

    def best(self, rollout_id: str, seq: int, value: Any) -> tuple[int, int] | None:
        """(base seq, shared units) of the longest prefix of ``value`` among earlier sequences, None if
        none is long enough; ``(seq, -1)`` when ``seq`` was already written (a repeat)."""
        candidates = self._cache.get(rollout_id)
        if candidates is None or len(value) < self._head:  # none, or too short to refer to anything
            return None
        self._cache.move_to_end(rollout_id)
        unit, best_seq, best = self._unit, None, 0
        for cand_seq, full in reversed(candidates):
            if cand_seq == seq:
                return seq, -1  # a repeat of a written row: INSERT OR IGNORE keeps the first copy
            if cand_seq > seq:
                continue
            if value.startswith(full):
                best_seq, best = cand_seq, len(full) // unit
                break
            if value[:self._head] != full[:self._head]:  # unrelated histories: no search
                continue
            shared = _common_prefix(value, full, unit)
            if shared > best:
                best_seq, best = cand_seq, shared
                # The whole value (a repeated prompt), or all of it but its last unit (a repeated input's
                # closing "]", where the earlier conversation goes on with its answer): none can beat it.
                if (shared + 1) * unit >= len(value):
                    break
        if best_seq is None or best < self._min:
            return None
        return best_seq, best

    def remember(self, rollout_id: str, seq: int, full: Any) -> None:
        candidates = self._cache.setdefault(rollout_id, [])
        candidates.append((seq, full))
        self._size += _size(full)
        if len(candidates) > CANDIDATES_PER_ROLLOUT:
            self._size -= _size(candidates.pop(0)[1])
        while self._size > self._limit and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._size -= sum(_size(f) for _, f in dropped)

    def drop(self, rollout_id: str, seq: int) -> None:
        candidates = self._cache.get(rollout_id)
        if not candidates:
            return
        self._size -= sum(_size(full) for s, full in candidates if s == seq)
        self._cache[rollout_id] = [(s, full) for s, full in candidates if s != seq]

    def forget(self, rollout_id: str) -> None:
        dropped = self._cache.pop(rollout_id, None)
        if dropped:
            self._size -= sum(_size(f) for _, f in dropped)


class PrefixSharer:
    """Rewrites span rows (whole prompts and input messages) into prefix-shared ones, in the order
    they are written. Used on one writer thread."""

    def __init__(self, cache_bytes: int = CACHE_BYTES) -> None:
        self._tokens = _Recent(4, MIN_SHARED_TOKENS, cache_bytes)
        self._text = _Recent(1, MIN_SHARED_CHARS, cache_bytes)

    def share(self, row: tuple) -> tuple:
        prompt, text = row[_PROMPT], row[_INPUT]
        tokens_ref = text_ref = None
        if prompt is not None and row[_BASE] is None:
            tokens_ref = self._tokens.best(row[0], row[1], prompt)
            if tokens_ref is not None and tokens_ref[1] < 0:
                return row
            self._tokens.remember(row[0], row[1], prompt + row[_RESPONSE])
        if text is not None and row[_IN_BASE] is None:
            text_ref = self._text.best(row[0], row[1], text)
            if text_ref is not None and text_ref[1] < 0:
                return row
            self._text.remember(row[0], row[1], conversation(text, row[_OUTPUT]))
        if tokens_ref is None and text_ref is None:
            return row
        out = list(row)
        if tokens_ref is not None:
            out[_BASE], out[_SHARED], out[_PROMPT] = tokens_ref[0], tokens_ref[1], prompt[tokens_ref[1] * 4:]
        if text_ref is not None:
            out[_IN_BASE], out[_IN_SHARED], out[_INPUT] = text_ref[0], text_ref[1], text[text_ref[1]:]
        return tuple(out)

    def drop(self, rollout_id: str, seq: int) -> None:
        """A span that will never be written (quarantined): no later prompt may refer to it."""
        self._tokens.drop(rollout_id, seq)
        self._text.drop(rollout_id, seq)

    def forget(self, rollout_id: str) -> None:
        """The rollout finished: its sequences are no longer needed."""
        self._tokens.forget(rollout_id)
        self._text.forget(rollout_id)


def _unresolved(what: str, seq: int, base: int, left: str) -> None:
    count(f"llm_calls_with_unresolved_{what}")
    report_failure(f"unresolved {what} reference", message=(
        f"lightning-rl: span {seq} refers to the {what} of span {base} of its rollout, which are not in the "
        f"store; it is read {left} (counted as llm_calls_with_unresolved_{what})"))


class PromptResolver:
    """Rebuilds whole prompts and input messages from one rollout's rows, read in ``seq`` order."""

    def __init__(self) -> None:
        self._full: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def resolve(self, seq: int, base: int | None, shared: int, tail: bytes, response: bytes) -> bytes | None:
        if base is None:
            prompt = tail
        else:
            full = self._full.get(base)
            if full is None or len(full) < shared * 4:
                _unresolved("prompt", seq, base, "without token ids (left out of training samples)")
                return None
            prompt = full[:shared * 4] + tail
        self._full[seq] = prompt + response
        return prompt

    def resolve_text(self, seq: int, base: int | None, shared: int, tail: str, output: str | None) -> str | None:
        if base is None:
            text = tail
        else:
            full = self._text.get(base)
            if full is None or len(full) < shared:
                _unresolved("messages", seq, base, "without its input messages")
                return None
            text = full[:shared] + tail
        self._text[seq] = conversation(text, output)
        return text
