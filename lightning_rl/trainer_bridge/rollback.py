"""Rollback: make an earlier version of a served name's policy live again (``lightning-rl policies rollback``).

The version's adapter (its folder is in its publish record) is loaded into every replica of the vLLM
server set (``replicas.py``) under the version's own name and in place under the live name (all replicas or
none: a replica that refuses raises a PublishError naming it, and nothing is recorded), then the store gets
a publish of that version (with its versioned name) (the latest publish is what the name
answers with: every process stamps its calls with it from then on) and a ``rolled_back`` decision. A running
``ContinuousTrainer`` of that name sees the new latest publish at its next step and goes on from those
weights (``continuous.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, shown
from ..records import PolicyRecord
from ..tracer.provider import tracing
from .replicas import Replicas


def rollback(store: Any, *, to: int, server_url: str | Sequence[str] | Replicas, served_name: str = "policy",
             reason: str = "by hand", figures: Mapping[str, Any] | None = None, timeout: float = 120.0) -> PolicyRecord:
    """Make version ``to`` of ``served_name`` live again (module doc); returns its publish record. Checks the
    version and its adapter folder before touching the server."""
    if isinstance(to, bool) or not isinstance(to, int) or to < 0:
        raise ConfigurationError(f"the version to roll back to must be an int >= 0, got {shown(to)}")
    records = store.policies(served_name)
    if not records:
        names = sorted({p.served_name for p in store.policies()})
        raise ConfigurationError(f"the store {store.url} holds no publish of {served_name!r} (it holds {names}); "
                                 "give the policy's served name with --served-name")
    chosen = [p for p in records if p.version == to]
    if not chosen:
        versions = sorted({p.version for p in records})
        raise ConfigurationError(f"version {to} of {served_name!r} was never published in {store.url} (published: "
                                 f"{versions}); give one of them to --to")
    record = chosen[-1]
    if record.adapter is None or not (Path(record.adapter) / "adapter_config.json").is_file():
        raise ConfigurationError(f"version {to} of {served_name!r} has no adapter folder at {record.adapter!r} (no "
                                 "adapter_config.json there); put the folder back at that path (from a backup of the "
                                 "trainer's adapters/), or roll back to another version")
    live = records[-1].version
    served_as = Replicas(server_url, timeout=timeout).publish(served_name, to, record.adapter)
    tracing.set_policy_version(to, model=served_name, served_as=served_as)  # this process's calls, as a publish
    published = store.record_policy(served_name, to, adapter=record.adapter, served_as=served_as)
    store.record_decision(served_name, to, "rolled_back", live_version=live, adapter=record.adapter, reason=reason,
                          figures=figures)
    return published
