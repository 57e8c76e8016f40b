"""Promote a candidate adapter trained elsewhere (verl, a replay, by hand) to a served vLLM through the gate
(``lightning-rl policies promote``).

The candidate (a PEFT LoRA folder of the base model the server serves, e.g. ``export-model --verl-checkpoint``'s
``adapter/``) is judged beside the live policy of ``served_name`` on held-out tasks by the gate (``gate.py``: the
same agent, the same test as continuous training's). Not worse: it is loaded under the live name
(``load_inplace``), recorded as that name's next version (its adapter folder in the publish, so ``policies
rollback`` can return to it or from it) and a ``promoted`` decision; worse: a ``refused`` decision, and the server
keeps serving the live policy. Both decisions carry the gate's figures. Without gate tasks there is no
evidence, so nothing is promoted (``ConfigurationError``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from .gate import Gate
from ..tracer.provider import tracing
from .replicas import Replicas


def promote(store: Any, adapter: str | Path, *, server_url: str | Sequence[str] | Replicas, served_name: str,
            gate_agent: Callable[[Any], Any], gate_tasks: Sequence[Any], gate_n: int = 1, margin: float = 0.1,
            confidence: float = 0.9, reason: str | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """Judge ``adapter`` against the live policy of ``served_name`` and publish it when not worse (module doc).
    Returns ``{"decision": "promoted" | "refused", "version": ..., "live_version": ..., "gate_*": ...}``."""
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigurationError(f"--adapter {str(adapter)!r} is not a LoRA adapter folder (no adapter_config.json); give "
                                 "one, e.g. the adapter/ that `lightning-rl export-model --verl-checkpoint` wrote")
    tasks = list(gate_tasks)
    if len(tasks) * gate_n < 2:
        raise ConfigurationError(f"the gate needs at least 2 tries per policy; got {len(tasks)} task(s) x gate_n={gate_n}: "
                                 "give more gate tasks or raise --gate-n")
    published = store.policies(served_name)
    live = published[-1].version if published else 0
    version = max(p.version for p in published) + 1 if published else 1
    gate = Gate(store, gate_agent, tasks, server_url=server_url, served_name=served_name, n=gate_n, margin=margin,
                confidence=confidence, timeout=timeout)
    try:
        test = gate.check(str(adapter.resolve()), live)
    finally:
        gate.close()
    figures = {f"gate_{k}": v for k, v in test.figures().items()}
    decision = "promoted" if test.not_worse else "refused"
    why = reason or (f"lower bound {test.lower_bound:.4f} {'>=' if test.not_worse else '<'} -margin {-test.margin:.4f}")
    if test.not_worse:
        served_as = Replicas(server_url, timeout=timeout).publish(served_name, version, adapter.resolve())
        tracing.set_policy_version(version, model=served_name, served_as=served_as)  # this process's, as a publish
        store.record_policy(served_name, version, adapter=str(adapter.resolve()), served_as=served_as)
    store.record_decision(served_name, version, decision, live_version=live, adapter=str(adapter.resolve()),
                          figures=figures, reason=why)
    return {"decision": decision, "served_name": served_name, "version": version, "live_version": live,
            "adapter": str(adapter.resolve()), **figures}
