"""Stores: the durable SQLite default, the in-memory one, the store server's client; the small protocols
they implement (``protocols.py``); trajectories, samples and the other queries written once over them
(``queries.py``); trajectory assembly, credit, training samples."""

from .assembly import assemble, llm_call_from_span
from .credit import CREDIT_ASSIGNERS, assign_credit, get_credit_assigner, register_credit, split_rewards
from .memory_store import InMemoryStore
from .protocols import PolicyLog, RewardLog, RolloutIndex, RolloutReader, SpanSink, Store, TaskQueue
from .queries import (expire_idle_running, policy_versions, resolve_rollout_id, samples, trajectories, trajectory,
                      wait_for_groups)
from .sqlite_store import SQLiteStore
from .training_samples import SampleStats, route_by_policy, trajectory_samples
from .uri import open_store

__all__ = [
    "CREDIT_ASSIGNERS",
    "InMemoryStore",
    "PolicyLog",
    "RewardLog",
    "RolloutIndex",
    "RolloutReader",
    "SQLiteStore",
    "SampleStats",
    "SpanSink",
    "Store",
    "TaskQueue",
    "assemble",
    "assign_credit",
    "expire_idle_running",
    "get_credit_assigner",
    "llm_call_from_span",
    "open_store",
    "policy_versions",
    "register_credit",
    "resolve_rollout_id",
    "route_by_policy",
    "samples",
    "split_rewards",
    "trajectories",
    "trajectory",
    "trajectory_samples",
    "wait_for_groups",
]
