"""Stores: the durable SQLite default, the in-memory one, trajectory assembly, credit, samples."""

from .assembly import assemble, llm_call_from_span
from .base import Store
from .credit import CREDIT_ASSIGNERS, assign_credit, get_credit_assigner, register_credit, split_rewards
from .memory_store import InMemoryStore
from .samples import SampleStats, route_by_policy, trajectory_samples
from .sqlite_store import SQLiteStore
from .uri import open_store

__all__ = [
    "CREDIT_ASSIGNERS",
    "InMemoryStore",
    "SQLiteStore",
    "SampleStats",
    "Store",
    "assemble",
    "assign_credit",
    "get_credit_assigner",
    "llm_call_from_span",
    "open_store",
    "register_credit",
    "route_by_policy",
    "split_rewards",
    "trajectory_samples",
]
