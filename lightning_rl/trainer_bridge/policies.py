"""Which policy trains on which sample: one policy is a team of one.

A trainer's policies are a mapping of agent names to served names (the names of their LoRAs on the
one base model; two agents may share one), where the key ``"*"`` means every agent. One policy,
``Trainer(served_name="policy")``, is ``{"*": "policy"}``; a team,
``Trainer(policies={"planner": "planner-lora", "solver": "solver-lora"})``, is that mapping. Every
rule below is the same for both:

* **Routing.** A sample trains the policy that served its call when that is one of ours (the
  span's served model name, ``Sample.policy``); any other sample (a call to a model nobody trains,
  or that named none) trains the ``"*"`` policy when there is one, and is otherwise left out and
  counted (``samples_unrouted``). So one policy trains every call its agents make, as a team trains
  each call the policy it went to.
* **Staleness.** A sample is as old as the version of the policy that served it; a call that named
  no served model counts as served by the ``"*"`` policy.
* **Agents trained.** All of them when ``"*"`` is there (or those ``agents=`` picks, a list or a
  pattern), else the mapping's agents (or the ``agents=`` list, each of which must have a policy).
* **Layout.** Where a run trains a single served name, its figures are also the metrics line's own
  (top level, under verl's names in the trackers) and its adapters sit at the root of the run's
  adapter folders (``adapters/v00003``, ``sft_adapter/``); with several, per served name only
  (``policies`` in the line, ``adapters/<served name>/v00003``). Per-policy figures are always under
  ``policies``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..diagnostics import count
from ..errors import ConfigurationError
from ..records import Sample

#: The key of the policy every agent trains (that of no agent named in the mapping).
EVERY_AGENT = "*"
EXAMPLE = 'policies={"planner": "planner-lora", "solver": "solver-lora"}'


class Policies:
    """Agent name (or ``"*"``) -> served name; the rules of the module doc."""

    def __init__(self, by_agent: Mapping[str, str]) -> None:
        if not isinstance(by_agent, Mapping) or not by_agent:
            raise ConfigurationError(f"policies must map agent names to served model names, e.g. {EXAMPLE}; "
                                     f"got {by_agent!r}")
        for agent, served in by_agent.items():
            if not isinstance(agent, str) or not agent or not isinstance(served, str) or not served:
                raise ConfigurationError(f"policies entry {agent!r}: {served!r} is not agent name -> served name "
                                         f"(both non-empty strings), e.g. {EXAMPLE}")
        self.by_agent: dict[str, str] = dict(by_agent)
        #: The served names trained, each once, in the mapping's order.
        self.served: list[str] = list(dict.fromkeys(self.by_agent.values()))
        self.every_agent: str | None = self.by_agent.get(EVERY_AGENT)

    @classmethod
    def of(cls, policies: Mapping[str, str] | None = None, *, served_name: str = "policy") -> Policies:
        """The trainer's arguments as one mapping: ``policies`` (a team) or ``{"*": served_name}``."""
        return cls({EVERY_AGENT: served_name} if policies is None else policies)

    def __repr__(self) -> str:
        return f"Policies({self.by_agent!r})"

    @property
    def single(self) -> bool:
        """One served name is trained: its figures are the run's too, its adapters at the folders' root."""
        return len(self.served) == 1

    def of_agent(self, agent: str | None) -> str | None:
        """The served name that ``agent``'s calls are meant for (None: the agent has no policy)."""
        return self.by_agent.get(agent, self.every_agent) if agent is not None else self.every_agent

    def agents(self, given: str | Sequence[str] | None) -> str | list[str] | None:
        """The agents whose samples are read (``trajectory_samples(agents=...)``; None: all of them)."""
        if self.every_agent is not None:
            return given if given is None or isinstance(given, str) else list(given)
        if given is None:
            return list(self.by_agent)
        if isinstance(given, str):
            raise ConfigurationError(f"with policies=, agents must list agent names, got the pattern {given!r}")
        missing = [a for a in given if a not in self.by_agent]
        if missing:
            raise ConfigurationError(f"agent(s) {missing} have no policy; add them to policies= (agent -> served "
                                     f"name; agents may share one) or leave them out of agents=")
        return list(given)

    def serving(self, sample: Sample) -> str | None:
        """The policy whose version ``sample``'s call carries: the one that served it, if it is ours (a call
        that named no served model: the ``"*"`` policy); None for a call to another model."""
        if sample.policy is None:
            return self.every_agent
        return sample.policy if sample.policy in self.served else None

    def trains(self, sample: Sample) -> str | None:
        """The policy ``sample`` trains (module doc, "Routing"); None: nobody's."""
        return sample.policy if sample.policy in self.served else self.every_agent

    def route(self, samples: Iterable[Sample]) -> tuple[dict[str, list[Sample]], int]:
        """Samples by the policy they train (every policy gets a list, maybe empty), and how many train
        none (also the process counter ``samples_unrouted``)."""
        routed: dict[str, list[Sample]] = {name: [] for name in self.served}
        unrouted = 0
        for sample in samples:
            policy = self.trains(sample)
            if policy is None:
                unrouted += 1
                count("samples_unrouted")
            else:
                routed[policy].append(sample)
        return routed, unrouted

    def off_their_policy(self, samples: Iterable[Sample]) -> int:
        """Samples of an agent with a policy whose call was served by another model (another agent's
        policy, or one nobody trains)."""
        return sum(1 for s in samples if (mine := self.of_agent(s.agent_name)) is not None and s.policy != mine)

    def folders(self, root: str | Path) -> dict[str, Path]:
        """Each policy's folder under ``root`` (module doc, "Layout")."""
        root = Path(root)
        return {name: root if self.single else root / name for name in self.served}

    def figures(self, per_policy: Mapping[str, Mapping[str, Any]], *, own: Sequence[str] = ()) -> dict[str, Any]:
        """A line's per-policy figures as the run writes them: under ``policies`` always, and where one
        served name is trained, its figures (less the keys in ``own``, which are the policy's alone)
        at the top level too (module doc, "Layout")."""
        out: dict[str, Any] = {}
        if self.single:
            out.update({k: v for k, v in per_policy[self.served[0]].items() if k not in own})
        out["policies"] = {name: dict(numbers) for name, numbers in per_policy.items()}
        return out
