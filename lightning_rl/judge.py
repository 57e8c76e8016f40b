"""A group-relative LLM judge: all tries of one task scored together, 0..1, by a rubric.

``GroupJudge(base_url=..., model=..., rubric=...)`` talks to any OpenAI-compatible endpoint (the served
model, another vLLM model, a hosted API). ``judge.score(task, answers)`` asks it once per group for
``{"scores": [...]}``, one number per answer, at temperature 0. With ``guided=True`` (the default) the
answer is constrained by a JSON schema (``response_format`` ``json_schema``, which vLLM enforces): n
scores, each one of 0, 0.25, 0.5, 0.75, 1, since a grammar can bound a list but not a float's value.

* **Hosted APIs.** The request is plain OpenAI chat completions: ``max_completion_tokens`` (what
  OpenAI's newer models require and vLLM reads), a ``strict`` JSON schema (OpenAI's structured outputs
  accept this one), the key from ``api_key`` or ``OPENAI_API_KEY``. Rate limits and server errors (408,
  409, 429, 5xx, a dropped connection, a timeout) are retried ``retries`` times, after the server's
  ``Retry-After`` (at most 60 s) or 0.5, 1, 2 s; other errors (a wrong key, an unsupported parameter)
  fail at once with the server's message. ``temperature=None`` omits it (reasoning models accept only
  their default). For a provider without JSON-schema outputs use ``guided=False``: the scores object is
  then read from the first JSON object in the reply that has ``scores``, so a fenced or explained
  answer still parses, and anything else is a failure.
* **Never a silent 0.** An answer that is not valid JSON, the wrong count, or a number outside 0..1,
  or a call that fails: ``score`` returns ``None`` for the whole group (the rollouts stay unrewarded),
  counts ``judge_failures`` and logs the cause once.
* **Cached by content**: the same model, rubric, task and answers are judged once per judge (and
  across runs with ``cache_path``, a JSON file); hits are counted (``judge_cache_hits``).
* **Never a training sample.** The judge's request goes over plain HTTP, not through the instrumented
  OpenAI client, and carries ``x-lightning-rl-no-capture``, so no rollout records it as an LLM call, also
  when a judge is asked from inside a traced agent. ``judge.reward_groups(store, group_ids)``
  writes each judged rollout's reward (name ``reward``, source ``function``) and a ``judge`` span of
  its own (operation ``judge``: model, scores, cache hit, the prompt's hash), which assembly does not
  take as an LLM call. ``Trainer(judge=...)`` calls it for groups whose tries have no reward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import semconv
from .boundaries import check_int, is_real
from .diagnostics import count, report_failure
from .errors import ConfigurationError, JudgeHTTPError
from .records import Reward, RewardSource, Span
from .store.assembly import assemble

log = logging.getLogger(__name__)

OP_JUDGE = "judge"
RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})  # a rate limit or a busy server: worth another try
SCALE = (0, 0.25, 0.5, 0.75, 1)  # guided decoding: a score is one of these (a grammar cannot bound a float)
DEFAULT_RUBRIC = ("Score each answer from 0 (wrong or useless) to 1 (fully correct and complete) for the task. "
                  "Compare the answers with each other: a better answer gets a higher score.")


def _retry_after(header: str | None, default: float) -> float:
    """Seconds to wait: the server's ``Retry-After`` in seconds (capped at 60), else ``default``."""
    try:
        value = float(header) if header is not None else default
    except ValueError:  # an HTTP date: rare from APIs; the backoff will do
        return default
    return min(max(value, 0.0), 60.0) if math.isfinite(value) else default


def _scores_object(text: str) -> Any:
    """The reply as JSON; failing that, the first JSON object in it that has ``scores`` (a model without
    guided decoding may fence its JSON or explain it). Raises the JSON error when there is none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as first:
        decoder = json.JSONDecoder()
        start = text.find("{")
        while start != -1:
            try:
                data, _ = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                data = None
            if isinstance(data, dict) and "scores" in data:
                return data
            start = text.find("{", start + 1)
        raise first


def response_format(n: int) -> dict[str, Any]:
    """The guided answer: ``{"scores": [...]}``, exactly n scores from ``SCALE`` (OpenAI's strict JSON schema
    subset, which vLLM also enforces)."""
    return {"type": "json_schema", "json_schema": {"name": "scores", "strict": True, "schema": {
        "type": "object", "required": ["scores"], "additionalProperties": False,
        "properties": {"scores": {"type": "array", "minItems": n, "maxItems": n,
                                  "items": {"type": "number", "enum": list(SCALE)}}}}}}


class GroupJudge:
    def __init__(self, *, base_url: str, model: str, rubric: str = DEFAULT_RUBRIC, api_key: str | None = None,
                 max_tokens: int = 256, timeout: float = 120.0, cache_path: str | Path | None = None,
                 guided: bool = True, retries: int = 3, temperature: float | None = 0.0) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigurationError(f"the judge's base_url must be an http(s) URL of an OpenAI-compatible server "
                                     f"(ending in /v1), got {base_url!r}")
        if not isinstance(rubric, str) or not rubric.strip():
            raise ConfigurationError("the judge needs a rubric (what a good answer is)")
        check_int(retries, "the judge's retries", maximum=1000, meaning="tries after a rate limit or a server error")
        self.base_url = base_url.rstrip("/")
        self.model, self.rubric = model, rubric
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "EMPTY")
        self.max_tokens, self.timeout, self.guided = max_tokens, timeout, guided
        self.retries, self.temperature = retries, temperature
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self._cache: dict[str, list[float]] = {}
        if self.cache_path is not None and self.cache_path.is_file():
            self._cache = json.loads(self.cache_path.read_text())
        self.calls = 0  # requests sent to the judge's server

    def prompt(self, task: Any, answers: Sequence[str]) -> list[dict[str, str]]:
        task_text = task if isinstance(task, str) else json.dumps(task, ensure_ascii=False, default=str)
        listed = "\n".join(f"Answer {i + 1}:\n{a}\n" for i, a in enumerate(answers))
        return [{"role": "system", "content": self.rubric + f' Reply with JSON only: {{"scores": [...]}} with '
                                                              f"{len(answers)} numbers between 0 and 1, in order."},
                {"role": "user", "content": f"Task:\n{task_text}\n\n{listed}"}]

    def _key(self, messages: list[dict[str, str]]) -> str:
        return hashlib.sha256(json.dumps([self.model, messages], sort_keys=True).encode()).hexdigest()

    def _parse(self, text: str, n: int) -> list[float]:
        data = _scores_object(text)
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            raise ValueError(f"expected {n} scores, got {scores!r}")
        out = []
        for s in scores:
            if not is_real(s) or not math.isfinite(s) or not 0 <= s <= 1:
                raise ValueError(f"a score is not a number in 0..1: {s!r}")
            out.append(float(s))
        return out

    def score(self, task: Any, answers: Sequence[str]) -> tuple[list[float] | None, dict[str, Any]]:
        """Scores for ``answers`` (in order), or None when the judge failed; and what happened
        (``cached``, ``prompt_sha256``, ``error``)."""
        messages = self.prompt(task, answers)
        key = self._key(messages)
        info: dict[str, Any] = {"prompt_sha256": key, "cached": False, "error": None}
        if key in self._cache:
            count("judge_cache_hits")
            info["cached"] = True
            return list(self._cache[key]), info
        body: dict[str, Any] = {"model": self.model, "messages": messages, "seed": 0,
                                "max_completion_tokens": self.max_tokens}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.guided:
            body["response_format"] = response_format(len(answers))
        try:
            text = self._request(body)
            scores = self._parse(text, len(answers))
        except Exception as exc:
            count("judge_failures")
            report_failure("the LLM judge", exc, message="lightning-rl: the LLM judge failed; its group stays "
                           "unrewarded (counted in judge_failures, the judge span has the cause; logged once)")
            info["error"] = f"{type(exc).__name__}: {exc}"[:500]
            return None, info
        self._cache[key] = scores
        if self.cache_path is not None:
            self.cache_path.write_text(json.dumps(self._cache))
        return scores, info

    def _request(self, body: dict[str, Any]) -> str:
        """The reply's text; retries what a rate limit or a busy server answers (module doc)."""
        import httpx

        for attempt in range(self.retries + 1):
            self.calls += 1
            wait = min(0.5 * 2 ** attempt, 8.0)
            try:
                response = httpx.post(f"{self.base_url}/chat/completions", json=body, timeout=self.timeout,
                                      headers={"authorization": f"Bearer {self.api_key}",
                                               semconv.NO_CAPTURE_HEADER: "judge"})
            except (httpx.TimeoutException, httpx.NetworkError) as exc:
                if attempt == self.retries:
                    raise
                log.warning("the judge's request failed (%s); retry %d of %d in %.1f s", exc, attempt + 1,
                            self.retries, wait)
            else:
                if response.status_code < 300:
                    return response.json()["choices"][0]["message"]["content"] or ""
                if response.status_code not in RETRY_STATUS or attempt == self.retries:
                    raise JudgeHTTPError(f"the judge's server answered {response.status_code}: {response.text[:300]}")
                wait = _retry_after(response.headers.get("retry-after"), wait)
                log.warning("the judge's server answered %d; retry %d of %d in %.1f s", response.status_code,
                            attempt + 1, self.retries, wait)
            count("judge_retries")
            time.sleep(wait)
        raise AssertionError("unreachable")

    def reward_groups(self, store: Any, group_ids: Sequence[str]) -> dict[str, int]:
        """Judge each group's succeeded tries that have no reward yet; write their rewards and judge spans.
        Returns counts: groups judged, groups failed (left unrewarded), rollouts rewarded."""
        done = {"judged_groups": 0, "judge_failed_groups": 0, "judge_rewarded_rollouts": 0}
        for group_id in group_ids:
            rows = store.rollout_page(group_id=group_id, status="succeeded", sort="rollout_id", descending=False,
                                      limit=1000).rows
            todo = [row.rollout for row in rows if row.reward is None]
            if not todo:
                continue
            spans_of, answers = {}, []
            for rollout, spans, rewards in store.rollout_data([r.rollout_id for r in todo]):
                calls = assemble(rollout, spans, rewards).llm_calls  # what the agent answered: its last call's text
                spans_of[rollout.rollout_id] = spans
                answers.append(calls[-1].response_text if calls else "")
            started = time.time_ns()
            scores, info = self.score(todo[0].task, answers)
            ended = time.time_ns()
            for i, rollout in enumerate(todo):
                attrs = {semconv.GEN_AI_OPERATION_NAME: OP_JUDGE, semconv.GEN_AI_REQUEST_MODEL: self.model,
                         semconv.ROLLOUT_ID: rollout.rollout_id, "lightning_rl.judge.cached": info["cached"],
                         "lightning_rl.judge.prompt_sha256": info["prompt_sha256"],
                         "lightning_rl.judge.group_size": len(todo)}
                if scores is not None:
                    attrs["lightning_rl.judge.score"] = scores[i]
                spans = spans_of[rollout.rollout_id]
                root = next((s for s in spans if s.parent_id is None), None)
                store.add_spans([Span(
                    rollout_id=rollout.rollout_id, seq=max((s.seq for s in spans), default=-1) + 1,
                    trace_id=root.trace_id if root else uuid.uuid4().hex, span_id=uuid.uuid4().hex[:16],
                    parent_id=root.span_id if root else None, name=f"judge {self.model}", start_ns=started,
                    end_ns=ended, status_code="ERROR" if scores is None else "OK",
                    status_message=info["error"], attributes=attrs)])
                if scores is not None:
                    store.write_reward(Reward(rollout_id=rollout.rollout_id, value=scores[i],
                                              source=RewardSource.FUNCTION))
            store.flush()
            if scores is None:
                done["judge_failed_groups"] += 1
            else:
                done["judged_groups"] += 1
                done["judge_rewarded_rollouts"] += len(todo)
        return done



def unrewarded_groups(store: Any, *, mode: str | None = None,
                      max_groups: int | None = None) -> tuple[list[str], int]:
    """The groups (oldest first) with at least one succeeded try that has no reward: what a judge can
    score after the fact (``lightning-rl judge``). Also how many unrewarded tries have no group: the
    judge compares a group's tries, so those are left out (and counted)."""
    groups: dict[str, None] = {}
    ungrouped = offset = 0
    while max_groups is None or len(groups) < max_groups:
        page = store.rollout_page(status="succeeded", mode=mode, sort="start_time", descending=False,
                                  offset=offset, limit=1000)
        for row in page.rows:
            if row.reward is None:
                if row.rollout.group_id is None:
                    ungrouped += 1
                else:
                    groups.setdefault(row.rollout.group_id, None)
        offset += len(page.rows)
        if not page.rows or offset >= page.total:
            break
    found = list(groups)
    return (found if max_groups is None else found[:max_groups]), ungrouped
