"""Credit assignment: how a rollout's rewards become one reward per LLM call. A registry, not a rule.

An assigner takes the number of LLM calls, the final reward (or None) and each call's step reward
(emitted rewards summed per call, 0.0 where none) and returns one reward per call (None = no reward).

Which rewards are "final" and which are "step" rewards (``split_rewards``), for one reward name:

* final: the latest rollout-level reward (returned by the agent, ``store.add_reward`` feedback, or a
  reward function; ``llm_call_index`` None). If there is none, the latest *emitted* reward is the
  final one (and is not also counted as a step reward).
* step: every other emitted reward, summed per LLM call (see ``tracer.rewards`` for which call an
  emitted reward belongs to; one emitted before any call finished goes to call 0).

Several agents (``assign_credit``): a reward without ``agent`` is the team's. An agent's own final
reward is found by the same rule among the rewards given with ``agent=`` that name (so
``emit_reward(v, agent="critic")`` at the end of a rollout is the critic's reward). Under every
rule but ``team`` it replaces the team reward for that agent's calls; under ``team`` it adds to it.
Every other agent's calls get the team reward. Credit is assigned along each agent's own sequence
of calls (``discounted`` counts back from that agent's last call).

Built in: ``final`` (the final reward to every call), ``discounted`` (gamma^(n-1-i) * final),
``per_step`` (step_i + final for every call), ``return_to_go`` (discounted sum of this and later
step rewards plus the discounted final), ``team`` (for teams of agents sharing a reward: every
call of every agent that took part gets the team reward plus that agent's own final reward, if it
has one, plus its step rewards; an agent with neither a team nor an own nor a step reward gets
None). Register your own with ``@register_credit("name")``; an assigner with the attribute
``agent_rewards = "add"`` receives team + own as ``final``, as ``team`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..diagnostics import count
from ..errors import ConfigurationError
from ..records import Reward, RewardSource
from ..registry import Registry

CreditAssigner = Callable[..., list[float | None]]
CREDIT_ASSIGNERS: Registry[CreditAssigner] = Registry(
    "credit assignment", hint="or register one with @lightning_rl.register_credit")
register_credit = CREDIT_ASSIGNERS.register
get_credit_assigner = CREDIT_ASSIGNERS.get


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


@register_credit("team")
def team_credit(n: int, final: float | None, steps: Sequence[float]) -> list[float | None]:
    return per_step_credit(n, final, steps)


team_credit.agent_rewards = "add"  # type: ignore[attr-defined]


def _final_of(rewards: Sequence[Reward]) -> Reward | None:
    final = None
    for r in rewards:
        if r.llm_call_index is None and r.source != RewardSource.EMITTED:
            final = r
    if final is None:
        emitted = [r for r in rewards if r.source == RewardSource.EMITTED]
        final = emitted[-1] if emitted else None
    return final


def split_rewards(rewards: Sequence[Reward], n_calls: int, name: str = "reward") -> tuple[float | None, list[float]]:
    """(team final reward, per-call step rewards) for the rewards called ``name``; rules in the module doc."""
    team, _, steps = _split(rewards, n_calls, name)
    return (team.value if team is not None else None), steps


def _own_call(call_agents: Sequence[str | None], index: int, agent: str) -> int | None:
    """The call an agent's step reward belongs to: the agent's latest call at or before ``index``
    (the call it was emitted after), else its first later call; None if the agent made no call."""
    for j in range(min(index, len(call_agents) - 1), -1, -1):
        if call_agents[j] == agent:
            return j
    for j in range(index + 1, len(call_agents)):
        if call_agents[j] == agent:
            return j
    return None


def _split(rewards: Sequence[Reward], n_calls: int, name: str,
           call_agents: Sequence[str | None] | None = None) -> tuple[Reward | None, dict[str, Reward], list[float]]:
    mine = [r for r in rewards if r.name == name]
    team = _final_of([r for r in mine if r.agent is None])
    per_agent: dict[str, Reward] = {}
    for agent in dict.fromkeys(r.agent for r in mine if r.agent is not None):
        final = _final_of([r for r in mine if r.agent == agent])
        if final is not None:
            per_agent[agent] = final
    finals = {id(r) for r in (team, *per_agent.values()) if r is not None}
    steps = [0.0] * n_calls
    for r in mine:
        if r.source != RewardSource.EMITTED or id(r) in finals:
            continue
        index = r.llm_call_index or 0
        if r.agent is not None and call_agents is not None and 0 <= index < n_calls \
                and call_agents[index] != r.agent:  # an agent's step reward goes to that agent's calls only
            own = _own_call(call_agents, index, r.agent)
            if own is None:
                count("agent_rewards_without_calls")
                continue
            index = own
        if 0 <= index < n_calls:
            steps[index] += r.value
        elif n_calls:  # a call index this rollout does not have (given by hand): no call to land on
            count("step_rewards_beyond_calls")
    return team, per_agent, steps


def assign_credit(
    call_agents: Sequence[str | None], rewards: Sequence[Reward], *, credit: str = "final",
    reward_name: str = "reward", **kwargs: Any,
) -> tuple[float | None, list[float | None]]:
    """(team final reward, one credited reward per LLM call), calls given by their agent names in order.

    Each agent's calls are credited along that agent's own sequence of calls, with the agent's own
    final reward when it has one (``emit_reward(v, agent=...)`` or ``add_reward(..., agent=...)``),
    else the team's.
    """
    assigner = get_credit_assigner(credit)
    add = getattr(assigner, "agent_rewards", "replace") == "add"
    n = len(call_agents)
    team, per_agent, steps = _split(rewards, n, reward_name, call_agents)
    team_value = team.value if team is not None else None
    out: list[float | None] = [None] * n
    for agent in dict.fromkeys(call_agents):
        indices = [i for i, a in enumerate(call_agents) if a == agent]
        own = per_agent.get(agent) if agent is not None else None
        if own is None:
            final = team_value
        elif add and team_value is not None:
            final = team_value + own.value
        else:
            final = own.value
        values = assigner(len(indices), final, [steps[i] for i in indices], **kwargs)
        for i, value in zip(indices, values):
            out[i] = value
    return team_value, out
