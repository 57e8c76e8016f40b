"""Prefix-shared token storage: each LLM call's prompt is stored as a reference plus its new tail.

An agent's next prompt almost always starts with its previous prompt + response (the chat history
grows); storing every prompt in full makes a rollout's bytes quadratic in its turns. A span row
therefore holds ``prompt_base_seq`` (an earlier LLM span of the same rollout), ``prompt_shared``
(how many tokens of that span's prompt + response this prompt starts with) and ``prompt_ids``
(the tokens after them). Readers get whole prompts back (:class:`PromptResolver`).

The writer finds the reference from the sequences it wrote recently (:class:`PrefixSharer`): it
needs nothing from the client and trusts no reference it did not make, so the store server does the
same for every client. A store that restarted, or a rollout evicted from the bounded cache, simply
stores its next prompt in full.
"""

from __future__ import annotations

from collections import OrderedDict

from ..diagnostics import count, report_failure

# Span row columns (after the 13 OTel columns): see rows.SPAN_COLUMNS.
TOKEN_COLUMNS = ("prompt_base_seq", "prompt_shared", "prompt_ids", "response_ids", "response_logprobs")
_BASE, _SHARED, _PROMPT, _RESPONSE = 13, 14, 15, 16

#: A reference is made only for at least this many shared tokens (shorter ones save nothing worth it).
MIN_SHARED_TOKENS = 16
#: Candidates kept per rollout (several agents of one rollout interleave their calls).
CANDIDATES_PER_ROLLOUT = 8
#: Bytes of sequences the writer keeps to find references in (oldest rollouts are forgotten first).
CACHE_BYTES = 64 * 2**20
_HEAD = MIN_SHARED_TOKENS * 4


def _common_prefix_tokens(a: bytes, b: bytes) -> int:
    """How many leading int32 tokens ``a`` and ``b`` share (binary search on C-level compares)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    if a[:hi * 4] == b[:hi * 4]:
        return hi
    while lo < hi:  # invariant: the first lo tokens match, the first hi+1 do not all match
        mid = (lo + hi + 1) // 2
        if a[:mid * 4] == b[:mid * 4]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixSharer:
    """Rewrites span rows (full prompts) into prefix-shared ones, in the order they are written.
    Used on one writer thread."""

    def __init__(self, cache_bytes: int = CACHE_BYTES) -> None:
        self._cache: OrderedDict[str, list[tuple[int, bytes]]] = OrderedDict()  # rollout -> [(seq, full)]
        self._bytes = 0
        self._limit = cache_bytes

    def share(self, row: tuple) -> tuple:
        prompt = row[_PROMPT]
        if prompt is None or row[_BASE] is not None:
            return row
        rollout_id, seq = row[0], row[1]
        candidates = self._cache.get(rollout_id)
        best_seq, best = None, 0
        if candidates is not None:
            self._cache.move_to_end(rollout_id)
            for cand_seq, full in reversed(candidates):
                if cand_seq == seq:
                    return row  # a repeat of a written row: INSERT OR IGNORE keeps the first copy
                if cand_seq > seq:
                    continue
                if prompt.startswith(full):
                    best_seq, best = cand_seq, len(full) // 4
                    break
                if prompt[:_HEAD] != full[:_HEAD]:  # unrelated histories: no search
                    continue
                shared = _common_prefix_tokens(prompt, full)
                if shared > best:
                    best_seq, best = cand_seq, shared
                    if shared * 4 == len(prompt):  # the whole prompt (a repeated prompt): none can beat it
                        break
        self._remember(rollout_id, seq, prompt + row[_RESPONSE])
        if best_seq is None or best < MIN_SHARED_TOKENS:
            return row
        return (*row[:_BASE], best_seq, best, prompt[best * 4:], *row[_RESPONSE:])

    def _remember(self, rollout_id: str, seq: int, full: bytes) -> None:
        candidates = self._cache.setdefault(rollout_id, [])
        candidates.append((seq, full))
        self._bytes += len(full)
        if len(candidates) > CANDIDATES_PER_ROLLOUT:
            self._bytes -= len(candidates.pop(0)[1])
        while self._bytes > self._limit and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._bytes -= sum(len(f) for _, f in dropped)

    def drop(self, rollout_id: str, seq: int) -> None:
        """A span that will never be written (quarantined): no later prompt may refer to it."""
        candidates = self._cache.get(rollout_id)
        if not candidates:
            return
        kept = [(s, full) for s, full in candidates if s != seq]
        self._bytes -= sum(len(full) for s, full in candidates if s == seq)
        self._cache[rollout_id] = kept

    def forget(self, rollout_id: str) -> None:
        """The rollout finished: its sequences are no longer needed."""
        dropped = self._cache.pop(rollout_id, None)
        if dropped:
            self._bytes -= sum(len(f) for _, f in dropped)


class PromptResolver:
    """Rebuilds whole prompts from one rollout's rows, read in ``seq`` order."""

    def __init__(self) -> None:
        self._full: dict[int, bytes] = {}

    def resolve(self, seq: int, base: int | None, shared: int, tail: bytes, response: bytes) -> bytes | None:
        if base is None:
            prompt = tail
        else:
            full = self._full.get(base)
            if full is None or len(full) < shared * 4:
                count("llm_calls_with_unresolved_prompt")
                report_failure("unresolved prompt reference", message=(
                    f"lightning-rl: span {seq} refers to the tokens of span {base} of its rollout, which are "
                    "not in the store; it is read without token ids (left out of training samples)"))
                return None
            prompt = full[:shared * 4] + tail
        self._full[seq] = prompt + response
        return prompt
