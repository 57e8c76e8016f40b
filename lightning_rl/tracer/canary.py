"""Canary routing: while a candidate policy is on canary, a share of production rollouts call it.

The continuous trainer (``trainer_bridge/continuous.py``, ``--canary SHARE``) loads a candidate into the
engine under a name of its own and records a ``canary`` decision about the live served name, with the
figures ``canary_name`` (the candidate's served name), ``canary_share`` and ``canary_until`` (when the
routing stops even if nobody records another decision: a trainer that died mid-canary leaves no lasting
route). Every process reads the latest decision about each served name with the publishes (the
provider's refresh); a canary holds until the next decision about that name (promoted, refused, rolled
back).

A production rollout (``mode="prod"``) is routed or not by its id: the same rollout id always draws the
same way for one candidate version, so every LLM call of a rollout goes to one policy, and the share is
held across processes without any coordination. A routed call is sent with the candidate's name as its
``model`` (the agent's own request is otherwise unchanged) and stamped with the candidate's version; the
span records the name the engine was asked for. Decisions whose figures cannot be read (another version's,
a hand-made record) route nothing, and are counted and logged once.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..diagnostics import count, report_failure


@dataclass(frozen=True, slots=True)
class Canary:
    served_name: str  # the live name the agent calls
    candidate: str  # the name the candidate is served under
    version: int  # the candidate's version (its calls are stamped with it)
    share: float  # of production rollouts, 0 < share < 1
    until: float  # epoch seconds: no routing after it

    def routes(self, rollout_id: str) -> bool:
        """Whether the rollout ``rollout_id`` calls the candidate (module doc: by its id)."""
        return zlib.crc32(f"{self.version}:{rollout_id}".encode()) < self.share * 2**32


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def canaries_from(decisions: Mapping[str, Any]) -> dict[str, Canary]:
    """The canaries in progress: ``decisions`` is the latest decision about each served name."""
    found: dict[str, Canary] = {}
    for name, decision in decisions.items():
        if getattr(decision, "decision", None) != "canary":
            continue
        figures = getattr(decision, "figures", None) or {}
        candidate, share, until = figures.get("canary_name"), figures.get("canary_share"), figures.get("canary_until")
        if not (isinstance(candidate, str) and candidate and candidate != name and _number(share) and 0 < share < 1
                and _number(until)):
            count("canary_decisions_unreadable")
            report_failure("an unreadable canary decision", message=(
                f"lightning-rl: the canary decision about {name!r} holds canary_name={candidate!r}, "
                f"canary_share={share!r}, canary_until={until!r} (a served name other than {name!r}, a share in "
                "(0, 1), a time are needed); no production call is routed by it (counted, logged once). Record "
                "another decision about the name (lightning-rl policies rollback, or the trainer's next one)"))
            continue
        found[name] = Canary(name, candidate, decision.version, float(share), float(until))
    return found
