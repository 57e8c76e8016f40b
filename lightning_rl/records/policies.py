"""What a trainer records about a served name's policy: each publish (``PolicyRecord``) and each decision
beside it (``Decision``, ``PolicyDecision``: the gate's figures, a promotion, a refusal, a canary, a rollback)."""

from __future__ import annotations

import time
from enum import StrEnum

from pydantic import Field

from ..boundaries import NonNegativeInt64
from .rollouts import _Record

class PolicyRecord(_Record):
    """One publish: the served model name answered with these weights from ``time`` on."""

    served_name: str = Field(min_length=1)
    version: NonNegativeInt64
    adapter: str | None = None
    time: float = Field(default_factory=time.time)
    #: Lineage: group ids of the rollouts this version was trained on, in batch order; None when not recorded.
    trained_on: list[str] | None = None
    #: The version-specific name every serving replica serves this version under (``policy@v5``): traced calls
    #: to ``served_name`` are sent to it and stamped ``version`` (trainer_bridge/replicas.py). None: loaded in
    #: place under ``served_name`` only.
    served_as: str | None = None


class Decision(StrEnum):
    """What was decided about a served name's policy (``PolicyDecision``)."""

    EVALUATED = "evaluated"  # the gate measured a candidate beside the live policy (its figures)
    PROMOTED = "promoted"  # the candidate went live (its publish is the policy record beside it)
    REFUSED = "refused"  # the candidate was not published; the live policy stayed
    ROLLED_BACK = "rolled_back"  # an earlier version was made live again (by hand, or by the watch)
    CANARY = "canary"  # the candidate serves a share of production under its own name (figures: canary_name,
    #                    canary_share, canary_until) until the next decision about the served name


class PolicyDecision(_Record):
    """A decision about ``served_name``'s policy, kept next to its publishes (``PolicyRecord``): the gate's
    figures, a promotion, a refusal, a rollback."""

    served_name: str = Field(min_length=1)
    version: NonNegativeInt64  # the candidate judged, or the version rolled back to
    decision: Decision
    live_version: NonNegativeInt64 | None = None  # what was live when it was decided (compared with, rolled back from)
    adapter: str | None = None  # the candidate's (or the restored version's) adapter folder
    figures: dict[str, float | int | bool | str | None] = Field(default_factory=dict)  # the test's (gate_*)
    reason: str | None = None
    time: float = Field(default_factory=time.time)
