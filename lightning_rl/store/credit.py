"""Credit assignment: how a rollout's rewards become one reward per LLM call. A registry, not a rule.

An assigner takes the number of LLM calls, the final reward (or None) and each call's step reward
(emitted rewards summed per call, 0.0 where none) and returns one reward per call (None = no reward).

Which rewards are "final" and which are "step" rewards (``split_rewards``), for one reward name:

* final: the latest rollout-level reward (returned by the agent, ``store.add_reward`` feedback, or a
  reward function; ``llm_call_index`` None). If there is none, the latest *emitted* reward is the
  final one (and is not also counted as a step reward).
* step: every other emitted reward, summed per LLM call (see ``tracer.rewards`` for which call an
  emitted reward belongs to; one emitted before any call finished goes to call 0).

Built in: ``final`` (the final reward to every call), ``discounted`` (gamma^(n-1-i) * final),
``per_step`` (step_i + final for every call), ``return_to_go`` (discounted sum of this and later
step rewards plus the discounted final). Register your own with ``@register_credit("name")``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import ConfigurationError, UnknownNameError
from ..records import Reward, RewardSource

CreditAssigner = Callable[..., list[float | None]]
CREDIT_ASSIGNERS: dict[str, CreditAssigner] = {}


def register_credit(name: str) -> Callable[[CreditAssigner], CreditAssigner]:
    def register(fn: CreditAssigner) -> CreditAssigner:
        CREDIT_ASSIGNERS[name] = fn
        return fn

    return register


def get_credit_assigner(name: str) -> CreditAssigner:
    try:
        return CREDIT_ASSIGNERS[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown credit assignment {name!r}; known: {', '.join(sorted(CREDIT_ASSIGNERS))} "
            "(or register one with @lightning_rl.register_credit)"
        ) from None


def _gamma(gamma: float) -> float:
    if not 0.0 <= gamma <= 1.0:
        raise ConfigurationError(f"gamma must be within [0, 1], got {gamma!r}")
    return gamma


@register_credit("final")
def final_credit(n: int, final: float | None, steps: Sequence[float]) -> list[float | None]:
    return [final] * n


@register_credit("discounted")
def discounted_credit(n: int, final: float | None, steps: Sequence[float], gamma: float = 0.9) -> list[float | None]:
    gamma = _gamma(gamma)
    if final is None:
        return [None] * n
    return [final * gamma ** (n - 1 - i) for i in range(n)]


@register_credit("per_step")
def per_step_credit(n: int, final: float | None, steps: Sequence[float]) -> list[float | None]:
    if final is None and not any(steps):
        return [None] * n
    base = final or 0.0
    return [steps[i] + base for i in range(n)]


@register_credit("return_to_go")
def return_to_go_credit(
    n: int, final: float | None, steps: Sequence[float], gamma: float = 1.0
) -> list[float | None]:
    gamma = _gamma(gamma)
    if final is None and not any(steps):
        return [None] * n
    out: list[float | None] = [0.0] * n
    running = final or 0.0
    for i in range(n - 1, -1, -1):
        running = steps[i] + (running if i == n - 1 else gamma * running)
        out[i] = running
    return out


def split_rewards(rewards: Sequence[Reward], n_calls: int, name: str = "reward") -> tuple[float | None, list[float]]:
    """(final reward, per-call step rewards) for the rewards called ``name``; rules in the module doc."""
    mine = [r for r in rewards if r.name == name]
    final: Reward | None = None
    for r in mine:
        if r.llm_call_index is None and r.source != RewardSource.EMITTED:
            final = r
    emitted = [r for r in mine if r.source == RewardSource.EMITTED]
    if final is None and emitted:
        final = emitted[-1]
    steps = [0.0] * n_calls
    for r in emitted:
        if r is final:
            continue
        index = r.llm_call_index or 0
        if n_calls and 0 <= index < n_calls:
            steps[index] += r.value
    return (final.value if final is not None else None), steps
