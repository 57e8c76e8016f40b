"""Reward helpers: the rewards agents usually need, named, checked and composable.

Each helper returns a ``Score``: a float (so an agent can ``return`` it, as it returns any reward) that
also carries its name and, for a composition, its parts. Returned from a traced agent, the total is
stored as the rollout's ``reward`` and each part as a reward of its own name (``numeric_match``,
``length_penalty``, ...), so the viewer and the metrics can tell them apart. ``score.emit()`` records
it mid-run the same way (``emit_reward``: on the last LLM call, for per-call credit such as a
tool-use step reward).

Helpers (a registry like the credit rules: ``REWARD_HELPERS``, ``register_reward_helper``,
``reward_helper(name)``):

* ``exact_match(answer, expected)``: 1 when equal (trimmed, case and runs of spaces ignored unless
  ``normalize=False``), else 0.
* ``numeric_match(answer, expected, abs_tol=1e-6, rel_tol=0)``: 1 when the last number in the answer
  is within tolerance of ``expected``, else 0 (an answer with no number is wrong: 0).
* ``regex_format(text, pattern, full=False)``: 1 when the text matches.
* ``json_schema(text, schema)``: 1 when the text is JSON valid under the schema (``jsonschema``).
* ``tool_use(tool_calls, name, schema=None)``: a step reward, 1 when one of the calls (openai objects
  or dicts) is to ``name`` with JSON arguments valid under ``schema``.
* ``length_penalty(tokens_or_text, target, scale=1)``: 0 up to ``target`` tokens (or characters),
  then falling linearly to ``-scale`` at twice the target, and no lower.
* ``weighted(*scores, weights=None)``: the weighted sum of scores; each is a part.

Bad input is an error that names it, never a silent 0: a non-finite or non-numeric ``expected``, a
negative tolerance, a pattern or schema that does not compile, unknown weights.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .boundaries import check_int
from .errors import ConfigurationError, check_reward
from .registry import Registry

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class Score(float):
    """A reward value with its name (``name``) and its parts (``reward_parts``: name -> value)."""

    name: str
    reward_parts: dict[str, float]

    def __new__(cls, value: float, name: str, parts: Mapping[str, float] | None = None) -> Score:
        obj = super().__new__(cls, check_reward(value, what=f"reward {name!r}"))
        obj.name = name
        obj.reward_parts = dict(parts) if parts is not None else {name: float(value)}
        return obj

    def __repr__(self) -> str:
        return f"Score({float(self)!r}, {self.name!r}, parts={self.reward_parts!r})"

    def emit(self, name: str = "reward", *, agent: str | None = None, llm_call_index: int | None = None) -> Score:
        """Record it in the running rollout now: the total as ``name`` and each part under its own name."""
        from .tracer import emit_reward

        emit_reward(float(self), name, agent=agent, llm_call_index=llm_call_index)
        for part, value in self.reward_parts.items():
            if part != name:
                emit_reward(value, part, agent=agent, llm_call_index=llm_call_index)
        return self


REWARD_HELPERS: Registry[Callable[..., Score]] = Registry(
    "reward helper", hint="or register one with @lightning_rl.rewards.register_reward_helper")
register_reward_helper = REWARD_HELPERS.register
reward_helper = REWARD_HELPERS.get


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


@register_reward_helper("exact_match")
def exact_match(answer: Any, expected: Any, *, normalize: bool = True) -> Score:
    if expected is None:
        raise ConfigurationError("exact_match needs the expected answer, got None")
    got, want = _text(answer), _text(expected)
    if normalize:
        got, want = " ".join(got.split()).casefold(), " ".join(want.split()).casefold()
    return Score(1.0 if got == want else 0.0, "exact_match")


@register_reward_helper("numeric_match")
def numeric_match(answer: Any, expected: Any, *, abs_tol: float = 1e-6, rel_tol: float = 0.0) -> Score:
    want = check_reward(expected, what="numeric_match's expected value")
    for name, tol in (("abs_tol", abs_tol), ("rel_tol", rel_tol)):
        if check_reward(tol, what=f"numeric_match's {name}") < 0:
            raise ConfigurationError(f"numeric_match's {name} must be >= 0, got {tol!r}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        got = float(answer)
    else:
        numbers = _NUMBER.findall(_text(answer))
        if not numbers:
            return Score(0.0, "numeric_match")
        got = float(numbers[-1])
    ok = math.isfinite(got) and math.isclose(got, want, abs_tol=abs_tol, rel_tol=rel_tol)
    return Score(1.0 if ok else 0.0, "numeric_match")


@register_reward_helper("regex_format")
def regex_format(text: Any, pattern: str | re.Pattern[str], *, full: bool = False) -> Score:
    try:
        compiled = re.compile(pattern) if isinstance(pattern, str) else pattern
    except re.error as exc:
        raise ConfigurationError(f"regex_format's pattern {pattern!r} does not compile: {exc}") from None
    matched = (compiled.fullmatch if full else compiled.search)(_text(text))
    return Score(1.0 if matched else 0.0, "regex_format")


def _validator(schema: Mapping[str, Any], who: str) -> Any:
    try:
        import jsonschema
    except ImportError:
        raise ConfigurationError(f"{who} needs the jsonschema package: pip install 'lightning-rl[rewards]'") from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConfigurationError(f"{who}'s schema is not a valid JSON schema: {exc.message}") from None
    return jsonschema.validators.validator_for(schema)(schema)


@register_reward_helper("json_schema")
def json_schema(text: Any, schema: Mapping[str, Any]) -> Score:
    validator = _validator(schema, "json_schema")
    try:
        data = json.loads(_text(text))
    except json.JSONDecodeError:
        return Score(0.0, "json_schema")
    return Score(1.0 if validator.is_valid(data) else 0.0, "json_schema")


def _call_parts(call: Any) -> tuple[str | None, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else getattr(call, "function", None)
    if fn is None:
        return None, None
    if isinstance(fn, Mapping):
        return fn.get("name"), fn.get("arguments")
    return getattr(fn, "name", None), getattr(fn, "arguments", None)


@register_reward_helper("tool_use")
def tool_use(tool_calls: Iterable[Any] | None, name: str, *, schema: Mapping[str, Any] | None = None) -> Score:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"tool_use needs the tool's name, got {name!r}")
    validator = _validator(schema, "tool_use") if schema is not None else None
    for call in tool_calls or ():
        called, arguments = _call_parts(call)
        if called != name:
            continue
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            continue
        if not isinstance(args, dict):
            continue
        if validator is None or validator.is_valid(args):
            return Score(1.0, "tool_use")
    return Score(0.0, "tool_use")


@register_reward_helper("length_penalty")
def length_penalty(tokens_or_text: Any, target: int, *, scale: float = 1.0) -> Score:
    check_int(target, "length_penalty's target", minimum=1, meaning="tokens or characters")
    scale = check_reward(scale, what="length_penalty's scale")
    n = len(tokens_or_text) if not isinstance(tokens_or_text, int) else tokens_or_text
    over = max(0, n - target) / target
    return Score(-scale * min(1.0, over), "length_penalty")


def weighted(*scores: Score, weights: Mapping[str, float] | None = None, name: str = "reward") -> Score:
    """The weighted sum of named scores (weight 1 unless ``weights`` names it); every score is a part."""
    if not scores:
        raise ConfigurationError("weighted needs at least one score")
    weights = dict(weights or {})
    parts: dict[str, float] = {}
    for score in scores:
        if not isinstance(score, Score):
            raise ConfigurationError(f"weighted takes the reward helpers' scores, got {score!r}; wrap a number "
                                     "as Score(value, 'its_name')")
        if score.name in parts:
            raise ConfigurationError(f"two scores are named {score.name!r}; give one another name with "
                                     f"Score(value, 'other_name')")
        parts.update(score.reward_parts if len(score.reward_parts) > 1 else {score.name: float(score)})
    unknown = set(weights) - {s.name for s in scores}
    if unknown:
        raise ConfigurationError(f"weights for scores not given: {', '.join(sorted(unknown))}; scores: "
                                 f"{', '.join(s.name for s in scores)}")
    total = sum(check_reward(weights.get(s.name, 1.0), what=f"the weight of {s.name!r}") * float(s) for s in scores)
    return Score(total, name, parts)


__all__ = ["REWARD_HELPERS", "Score", "exact_match", "json_schema", "length_penalty", "numeric_match",
           "register_reward_helper", "regex_format", "reward_helper", "tool_use", "weighted"]
