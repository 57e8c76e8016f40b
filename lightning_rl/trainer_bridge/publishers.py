"""Weight publishers: new weights to the served model, and the new policy version to the tracer.

A registry (``register_publisher``); built in: ``vllm_lora``, which saves a PEFT LoRA adapter and
hot-loads it into every vLLM OpenAI server of a replica set (``replicas.py``) under the version's own
name (``policy@v5``) and in place under the stable name agents call
(``POST /v1/load_lora_adapter``; the servers run with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). A publish is all replicas or none: a replica that still fails
after its retries makes it raise a ``PublishError`` naming it, and nothing is recorded.

``publish_and_record`` is what trainers call: the publish, then a record of it in the store
(served name, version, adapter, time, and ``served_as``: the versioned name), from which every process
that traces into that store stamps its LLM calls (and sends them to the versioned name), so runner
processes, Ray actors and gateway agents agree with the trainer and with the replica that answers.
A publisher may set ``served_as`` (the name its last publish is served under) for the record.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import PublishError
from ..registry import Registry
from ..tracer.provider import tracing
from .replicas import Replicas


class Publisher(Protocol):
    served_name: str

    def publish(self, model: Any, version: int) -> str | None:
        """Make ``version`` live; returns where its weights are (an adapter path), if anywhere."""
        ...


def publish_and_record(publisher: Publisher, store: Any, model: Any, version: int,
                       trained_on: Sequence[str] | None = None) -> str | None:
    """Publish ``version`` and record the publish in ``store`` once it is live, with the groups it was
    trained on when given (a replay rebuilds the run's batches from them). Returns the adapter's path."""
    adapter = publisher.publish(model, version)
    served_as = getattr(publisher, "served_as", None)
    store.record_policy(publisher.served_name, version, adapter=None if adapter is None else str(adapter),
                        **({"trained_on": list(trained_on)} if trained_on is not None else {}),
                        **({"served_as": served_as} if served_as is not None else {}))
    return None if adapter is None else str(adapter)


PUBLISHERS: Registry[Callable[..., Publisher]] = Registry(
    "publisher", hint="or register one with @register_publisher")
register_publisher = PUBLISHERS.register


def make_publisher(name: str, **kwargs: Any) -> Publisher:
    """A publisher from the registry, built with ``kwargs``."""
    return PUBLISHERS.get(name)(**kwargs)


def _post(url: str, body: dict[str, Any], timeout: float) -> str:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise PublishError(f"{url} answered {exc.code}: {detail}") from None
    except OSError as exc:
        raise PublishError(f"cannot reach {url}: {exc}; is the vLLM server running with --enable-lora?") from None


def check_served(server_url: str | Sequence[str] | Replicas, names: Sequence[str], timeout: float = 30.0) -> None:
    """Every name in ``names`` is served as an adapter by every replica of ``server_url`` (one URL or a
    replica set): listed by ``/v1/models`` and not the base model itself. Raises a
    :class:`ConfigurationError` naming the replica and the name."""
    Replicas(server_url, timeout=timeout).check_served(names)


def load_served(server_url: str | Sequence[str] | Replicas, served_name: str, adapter: str | Path, *,
                timeout: float = 120.0) -> None:
    """Load the adapter folder ``adapter`` into every replica of ``server_url`` (one URL or a replica set)
    under ``served_name`` (``load_inplace``: it replaces what that name served; a failed load is retried,
    ``replicas.py``). The gate loads candidates with it, the canary its candidate."""
    Replicas(server_url, timeout=timeout).load(served_name, adapter)


def unload_served(server_url: str | Sequence[str] | Replicas, served_name: str, *, timeout: float = 30.0) -> None:
    """Unload ``served_name`` from every replica (frees its LoRA slot); a refusal is raised as PublishError."""
    failed = Replicas(server_url, timeout=timeout).unload(served_name)
    if failed:
        raise PublishError("; ".join(str(e) for e in failed.values()))


def save_adapter(model: Any, adapter_dir: Path, version: int) -> str:
    """Save ``model``'s adapter (``save_pretrained``) as ``adapter_dir/vNNNNN``; returns its absolute path."""
    path = (adapter_dir / f"v{version:05d}").resolve()
    model.save_pretrained(str(path))
    return str(path)


@register_publisher("adapter_dir")
class AdapterDirPublisher:
    """Save each version's adapter under ``adapter_dir/vNNNNN`` and serve nothing (a replay)."""

    def __init__(self, *, adapter_dir: str | Path, served_name: str = "policy") -> None:
        self.adapter_dir = Path(adapter_dir)
        self.served_name = served_name

    def publish(self, model: Any, version: int) -> str:
        return save_adapter(model, self.adapter_dir, version)


@register_publisher("vllm_lora")
class VLLMLoRAPublisher:
    """Hot-load a PEFT LoRA adapter into every replica of ``server_url`` (one URL, a comma list, a list, or
    a ``Replicas``) under the version's own name and in place under ``served_name`` (``replicas.py``).
    ``versioned=False``: in place only, as before replica sets (a server without LoRA slots to spare);
    calls are then stamped with the store's latest version, whichever replica answers."""

    def __init__(self, *, server_url: str | Sequence[str] | Replicas, adapter_dir: str | Path,
                 served_name: str = "policy", timeout: float = 120.0, versioned: bool = True) -> None:
        self.replicas = Replicas(server_url, timeout=timeout)
        self.server_url = self.replicas.urls[0]
        self.adapter_dir = Path(adapter_dir)
        self.served_name = served_name
        self.timeout = timeout
        self.versioned = versioned
        self.served_as: str | None = None  # the versioned name of the last publish (publish_and_record records it)

    def publish(self, model: Any, version: int) -> str:
        """``model``: a PEFT model (``save_pretrained`` writes the adapter). Sets ``version`` for this
        process's tracer; returns the adapter's path. Raises PublishError (module doc) with nothing live."""
        path = save_adapter(model, self.adapter_dir, version)
        self.served_as = None
        if self.versioned:
            self.served_as = self.replicas.publish(self.served_name, version, path)
        else:
            self.replicas.load(self.served_name, path)
        tracing.set_policy_version(version, model=self.served_name, served_as=self.served_as)
        return path
