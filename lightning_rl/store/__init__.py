"""Stores: the durable SQLite default, the in-memory one, the store server's client; the small protocols
they implement (``protocols.py``); trajectories, samples and the other queries written once over them
(``queries.py``); trajectory assembly, credit, training samples.

Laid out as a kit (``docs/extending.md``, "Add a store backend"):

* each backend on its own: ``sqlite/``, ``postgres/``, ``http/`` (the client and the store server),
  ``memory_store.py``; each registers its URL schemes (``kit/backends.py``) when imported here;
* ``kit/``: the registry, ``KitStore`` (the funnel, ingest, queue and queries over a backend's storage
  primitives) and the SQL rollout queries by dialect;
* what no backend owns: ``protocols.py``, ``uri.py``, ``queries.py``, ``assembly.py``, ``credit.py``,
  ``training_samples.py``, ``export.py``/``parquet.py``, and the machinery backends share (the writer's ops
  ``ops.py``, rows ``rows.py``, the wire format ``wire/``, the background writer ``writer.py``/``durable.py``/
  ``spill.py``, ``quarantine.py``, ``erasure.py`` (what each backend keeps and erases; how, in its folder),
  ``task_queue.py``, ``tokens.py``, ``checks.py``, ``scan.py``).

``sqlite_store.py``, ``postgres_store.py``, ``http_store.py``, ``server.py`` and ``server_auth.py`` are the
module paths from before the folders, kept importable (each is the moved module itself).
"""

from . import sqlite, memory_store, http, postgres  # noqa: F401  the built-in backends, registered in this order
from .assembly import assemble, llm_call_from_span
from .credit import CREDIT_ASSIGNERS, assign_credit, get_credit_assigner, register_credit, split_rewards
from .memory_store import InMemoryStore
from .protocols import PolicyLog, RewardLog, RolloutIndex, RolloutReader, SpanSink, Store, TaskQueue
from .queries import (expire_idle_running, policy_versions, resolve_rollout_id, samples, trajectories, trajectory,
                      wait_for_groups)
from .sqlite.store import SQLiteStore
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
