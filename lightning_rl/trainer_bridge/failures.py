"""Failed rollouts in the gradient: the model's failures are trained on, infrastructure failures are not.

A rollout that failed because of what the model wrote (a malformed tool call, bad arguments, an answer
the agent could not parse: any exception of the agent's own code) is a sample like any other, with the
failure reward (default 0.0): the policy learns not to write it. A rollout that failed because of the
world (the engine unreachable, a lease lost, a timeout: ``INFRA_ERRORS`` and every ``timed_out``
rollout) says nothing about the policy, and since it leaves its group short, the whole group is
dropped from the batch (its other tries would be compared with a wrong baseline). The local trainer and
the verl agent loop use the same rule (``failure_kind``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..records import Rollout, RolloutStatus, Sample, Trajectory

# Exception type names (the leaf type the rollout's error starts with) that mean "not the model".
INFRA_ERRORS = frozenset({
    # the OpenAI client and httpx: the engine did not answer
    "APIConnectionError", "APITimeoutError", "InternalServerError", "RateLimitError", "ServiceUnavailableError",
    "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "RemoteProtocolError",
    # the standard library
    "ConnectionError", "ConnectionRefusedError", "ConnectionResetError", "ConnectionAbortedError",
    "BrokenPipeError", "TimeoutError",
    # ours: the store went away under the agent; a sandbox could not start or died (lightning_rl.sandbox)
    "StoreError", "SandboxError",
})


def failure_kind(rollout: Rollout | Trajectory, infra_errors: Iterable[str] = INFRA_ERRORS) -> str | None:
    """``None`` for a success, ``"infra"`` for a failure that is not the model's, else ``"model"``."""
    if rollout.status == RolloutStatus.SUCCEEDED:
        return None
    if rollout.status != RolloutStatus.FAILED:  # timed_out (a lease expired, a timeout), or never finished
        return "infra"
    name = (rollout.error or "").split(":", 1)[0].strip()
    return "infra" if name in frozenset(infra_errors) else "model"


def with_failure_reward(samples: Sequence[Sample], reward: float) -> list[Sample]:
    """The samples of a rollout the model made fail, rewarded ``reward`` (credit does not apply)."""
    return [s.model_copy(update={"reward": reward, "token_rewards": None}) for s in samples]


@dataclass
class FailureCounts:
    """What the failures did to a batch (one metrics line)."""

    model_failures: int = 0  # trained on, with the failure reward
    infra_failures: int = 0
    groups_dropped: int = 0  # groups with an infrastructure failure, left out whole
    tries_dropped: int = 0  # all the tries of those groups

    def as_metrics(self) -> dict[str, int]:
        return {"model_failures": self.model_failures, "infra_failures": self.infra_failures,
                "groups_dropped_infra": self.groups_dropped, "tries_dropped_infra": self.tries_dropped}
