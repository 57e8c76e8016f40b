"""Trajectories into training samples, at two levels.

* ``call``: one sample per LLM call (prompt ids, response ids, mask all 1, engine logprobs, the
  call's credited reward).
* ``trajectory``: consecutive calls of one agent to one served model merge into one sample while
  each prompt extends the previous prompt + response as an exact token prefix; the tokens in between
  (tool results, user turns, template glue) join the response with mask 0 and logprob 0.0. A call whose prompt breaks the
  prefix starts a new sample; the break is counted in ``SampleStats.splits``. The merged sample's
  ``reward`` is the credited reward of its last call (what trainers place on the last token).
  ``token_rewards`` holds every merged call's credited reward at that call's last generated token
  (0.0 elsewhere), for per-turn analysis. These are credited values, not per-step rewards: under
  ``final`` credit every call holds the same reward, so they must not be summed into a return.

Calls without engine token ids are never turned into samples (re-tokenized text is not what the
model produced); they are counted in ``SampleStats.missing_token_ids``.

Every sample carries ``policy``: the served model name its calls went to. With several policies (a
LoRA per agent, served by one vLLM under their own names), ``route_by_policy`` splits samples by
that name, the name the engine actually served, never a guess from the agent's name.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from ..diagnostics import count
from ..errors import ConfigurationError
from ..records import LLMCall, Sample, TokenIdsSource, Trajectory

LEVELS = ("call", "trajectory")


@dataclass(slots=True)
class SampleStats:
    samples: int = 0
    splits: int = 0
    missing_token_ids: int = 0
    skipped_unrewarded: int = 0
    #: Samples whose served model name is none of the trained policies' (``route_by_policy``).
    unrouted: int = 0

    def add(self, other: "SampleStats") -> None:
        self.samples += other.samples
        self.splits += other.splits
        self.missing_token_ids += other.missing_token_ids
        self.skipped_unrewarded += other.skipped_unrewarded
        self.unrouted += other.unrouted


def _agent_filter(agents: str | Sequence[str] | None):
    if agents is None:
        return lambda name: True
    if isinstance(agents, str):
        pattern = re.compile(agents)
        return lambda name: name is not None and pattern.fullmatch(name) is not None
    wanted = set(agents)
    return lambda name: name in wanted


def _usable(calls: Iterable[LLMCall], stats: SampleStats, keep) -> list[LLMCall]:
    out = []
    for c in calls:
        if not keep(c.agent_name):
            continue
        if c.token_ids_source == TokenIdsSource.MISSING or not c.response_token_ids:
            stats.missing_token_ids += 1
            continue
        out.append(c)
    return out


def _logprobs(call: LLMCall) -> list[float] | None:
    lp = call.response_logprobs
    if lp is not None and len(lp) == len(call.response_token_ids):
        return list(lp)
    return None


def trajectory_samples(
    traj: Trajectory, *, level: str = "call", agents: str | Sequence[str] | None = None
) -> tuple[list[Sample], SampleStats]:
    """Samples of one trajectory. ``agents``: names, or a regex (full match) of agent names to keep."""
    if level not in LEVELS:
        raise ConfigurationError(f"sample level {level!r} is not one of {', '.join(LEVELS)}")
    stats = SampleStats()
    calls = _usable(traj.llm_calls, stats, _agent_filter(agents))
    common = dict(rollout_id=traj.rollout_id, group_id=traj.group_id)
    samples: list[Sample] = []
    if level == "call":
        for c in calls:
            samples.append(
                Sample(
                    **common,
                    prompt_ids=c.prompt_token_ids,
                    response_ids=c.response_token_ids,
                    response_mask=[1] * len(c.response_token_ids),
                    rollout_logprobs=_logprobs(c),
                    reward=c.reward,
                    agent_name=c.agent_name,
                    policy=c.model,
                    policy_version=c.policy_version,
                    llm_call_indices=[c.index],
                )
            )
        stats.samples = len(samples)
        return samples, stats

    current: Sample | None = None
    context: list[int] = []
    for c in calls:
        if (current is not None and c.agent_name == current.agent_name and c.model == current.policy
                and c.prompt_token_ids[: len(context)] == context):
            observation = c.prompt_token_ids[len(context):]
            n_obs, n_resp = len(observation), len(c.response_token_ids)
            current.response_ids += observation + c.response_token_ids
            current.response_mask += [0] * n_obs + [1] * n_resp
            lp = _logprobs(c)
            if current.rollout_logprobs is not None and lp is not None:
                current.rollout_logprobs += [0.0] * n_obs + lp
            else:
                current.rollout_logprobs = None
            current.token_rewards += [0.0] * (n_obs + n_resp)
            if c.reward is not None:
                current.token_rewards[-1] = c.reward
            current.reward = c.reward
            current.llm_call_indices.append(c.index)
            current.policy_version = c.policy_version if current.policy_version is None else current.policy_version
        else:
            if current is not None:
                stats.splits += 1
            n_resp = len(c.response_token_ids)
            token_rewards = [0.0] * n_resp
            if c.reward is not None and n_resp:
                token_rewards[-1] = c.reward
            current = Sample(
                **common,
                prompt_ids=list(c.prompt_token_ids),
                response_ids=list(c.response_token_ids),
                response_mask=[1] * n_resp,
                rollout_logprobs=_logprobs(c),
                reward=c.reward,
                token_rewards=token_rewards,
                agent_name=c.agent_name,
                policy=c.model,
                policy_version=c.policy_version,
                llm_call_indices=[c.index],
            )
            samples.append(current)
        context = current.prompt_ids + current.response_ids
    stats.samples = len(samples)
    return samples, stats


def route_by_policy(samples: Iterable[Sample], policies: Collection[str],
                    stats: SampleStats | None = None) -> dict[str, list[Sample]]:
    """Samples split by the policy that trains on them: the served model name their calls went to
    (``Sample.policy``). Every policy in ``policies`` gets a list (maybe empty); a sample served under
    any other name is left out and counted (``stats.unrouted`` when given, and always the process
    counter ``samples_unrouted``): a call to a model nobody trains."""
    if isinstance(policies, str) or not policies:
        raise ConfigurationError(f"policies must be a non-empty collection of served model names, got {policies!r}")
    routed: dict[str, list[Sample]] = {name: [] for name in policies}
    for sample in samples:
        bucket = routed.get(sample.policy) if sample.policy is not None else None
        if bucket is None:
            count("samples_unrouted")
            if stats is not None:
                stats.unrouted += 1
            continue
        bucket.append(sample)
    return routed


def group_keys(samples: Sequence[Sample]) -> list[str]:
    """Each sample's group for group-relative advantages: its task group (else its rollout), and,
    when the samples come from more than one policy, per policy too, so that each policy's
    attempts are compared with that policy's own (a team's planner with planners, not solvers)."""
    keys = [s.group_id or s.rollout_id or f"sample-{i}" for i, s in enumerate(samples)]
    if len({s.policy for s in samples}) > 1:
        keys = [f"{k}|policy={s.policy}" for k, s in zip(keys, samples)]
    return keys
