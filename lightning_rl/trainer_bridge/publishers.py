"""Weight publishers: new weights to the served model, and the new policy version to the tracer.

A registry (``register_publisher``); built in: ``vllm_lora``, which saves a PEFT LoRA adapter and
hot-loads it into a running vLLM OpenAI server under a stable name
(``POST /v1/load_lora_adapter`` with ``load_inplace``; the server runs with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). Agents call the model by that name.

``publish_and_record`` is what trainers call: the publish, then a record of it in the store
(served name, version, adapter, time), from which every process that traces into that store
stamps its LLM calls, so runner processes, Ray actors and gateway agents agree with the trainer.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigurationError, PublishError
from ..registry import Registry
from ..tracer.provider import tracing


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
    store.record_policy(publisher.served_name, version, adapter=None if adapter is None else str(adapter),
                        **({"trained_on": list(trained_on)} if trained_on is not None else {}))
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


def check_served(server_url: str, names: Sequence[str], timeout: float = 30.0) -> None:
    """Every name in ``names`` is served as an adapter by the OpenAI server at ``server_url``: listed
    by ``/v1/models`` and not the base model itself. Raises a :class:`ConfigurationError` naming it."""
    url = server_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            listed = {m.get("id"): m for m in json.loads(response.read()).get("data", [])}
    except (OSError, ValueError) as exc:
        raise PublishError(f"cannot list the served models at {url}: {exc}") from None
    for name in names:
        model = listed.get(name)
        if model is None:
            raise ConfigurationError(f"the server at {server_url} does not serve {name!r} (it serves "
                                     f"{sorted(listed)}); start vLLM with --enable-lora --max-loras {len(names)}")
        if "parent" in model and model["parent"] is None:
            raise ConfigurationError(f"{name!r} is the base model's own name on {server_url}; give the policy "
                                     f"another served name (its LoRA is loaded under it)")


def load_served(server_url: str, served_name: str, adapter: str | Path, *, timeout: float = 120.0) -> None:
    """Load the adapter folder ``adapter`` into the vLLM server at ``server_url`` under ``served_name``
    (``load_inplace``: it replaces what that name served). The gate loads candidates with it; a rollback,
    the live name's older adapter."""
    base = server_url.rstrip("/").removesuffix("/v1")
    _post(f"{base}/v1/load_lora_adapter", {"lora_name": served_name, "lora_path": str(adapter), "load_inplace": True},
          timeout)


def unload_served(server_url: str, served_name: str, *, timeout: float = 30.0) -> None:
    """Unload ``served_name`` from the server (frees its LoRA slot); an error is raised as PublishError."""
    base = server_url.rstrip("/").removesuffix("/v1")
    _post(f"{base}/v1/unload_lora_adapter", {"lora_name": served_name}, timeout)


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
    """Hot-load a PEFT LoRA adapter into vLLM under ``served_name``, replacing the previous one."""

    def __init__(self, *, server_url: str, adapter_dir: str | Path, served_name: str = "policy",
                 timeout: float = 120.0) -> None:
        if not server_url.startswith(("http://", "https://")):
            raise ConfigurationError(f"server_url must be http(s)://host:port, got {server_url!r}")
        self.server_url = server_url.rstrip("/").removesuffix("/v1")
        self.adapter_dir = Path(adapter_dir)
        self.served_name = served_name
        self.timeout = timeout

    def publish(self, model: Any, version: int) -> str:
        """``model``: a PEFT model (``save_pretrained`` writes the adapter). Sets ``version`` for this
        process's tracer; returns the adapter's path."""
        path = save_adapter(model, self.adapter_dir, version)
        load_served(self.server_url, self.served_name, path, timeout=self.timeout)
        tracing.set_policy_version(version, model=self.served_name)
        return path
