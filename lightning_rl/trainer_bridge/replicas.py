"""Replica sets: the vLLM servers that serve one policy, kept on one version, with every traced call
stamped with the version of the name it was sent to.

A replica set is the list of vLLM OpenAI servers behind a balancer (``Replicas("http://a:8000,http://b:8000")``,
or a list; one URL is a set of one). The publisher, the gate, the canary, ``policies rollback``,
``policies sync`` and the continuous trainer all take one.

Publishing version ``k`` of the served name ``N`` (``Replicas.publish``):

1. the adapter is loaded on every replica at once under its versioned name ``N@vk`` (``versioned_name``).
   A replica whose load fails is tried again (``retries`` times, with back-off; counted as
   ``replica_load_retries``, logged). A replica that still fails: the versioned name is unloaded from
   the replicas that took it and a :class:`PublishError` names the replica and its answer. Nothing is
   recorded and nobody's calls change: a publish is all replicas or none.
2. it is loaded in place under ``N`` on every replica, for clients that are not traced. A replica that
   fails this (after its retries) is counted (``replica_stable_load_failures``) and logged, and the
   publish goes on: no traced call is sent to ``N``, and ``reconcile`` (below) puts it right.
3. versioned names of ``N`` at or below ``k - keep`` are unloaded (a process that has not read the new
   publish yet still calls ``N@v(k-1)``: the last ``keep`` stay).

The publish is then recorded with ``served_as="N@vk"`` (``publishers.publish_and_record``). Every tracing
process reads it with the publishes (``tracer/provider.py``) and sends a traced call for ``N`` to ``N@vk``,
stamped ``k``: whichever replica the balancer picks, it answers with version ``k``'s weights (all of
them serve that name), so no recorded call carries a version its replica did not serve. The span keeps
``N`` as the model asked for (samples are routed to policies by it); ``gen_ai.response.model`` is the
versioned name that answered.

Where the adapter comes from: vLLM 0.32 loads a LoRA only from a path its own process can read
(``/v1/load_lora_adapter`` takes a path; nothing uploads one). So the trainer's adapter folder must be at
the same path on every replica's host: a shared filesystem (NFS, a cluster volume) mounted at the same
place. A replica that cannot read it answers 404, and the error says so.

``reconcile`` (run by the continuous trainer at each check, and by ``lightning-rl policies sync``) reads
every replica's ``/v1/models`` and loads the live publish where it is missing: a replica that restarted
serves the live version again under both names.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, PublishError, shown

log = logging.getLogger(__name__)


def versioned_name(served_name: str, version: int) -> str:
    """The name version ``version`` of ``served_name`` is served under on every replica (``policy@v5``)."""
    return f"{served_name}@v{version}"


def _version_of(name: str, served_name: str) -> int | None:
    match = re.fullmatch(re.escape(served_name) + r"@v(\d+)", name)
    return int(match.group(1)) if match else None


def replica_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """The replica set's base URLs (no ``/v1``) from a URL, a comma list, or a list of either; each one
    checked to be ``http(s)://host:port``, duplicates dropped."""
    items = [urls] if isinstance(urls, str) else list(urls) if isinstance(urls, (list, tuple)) else None
    if items is None or not all(isinstance(u, str) for u in items):
        raise ConfigurationError(f"replicas must be a URL, a comma list of URLs or a list of them, got {shown(urls)}")
    found: list[str] = []
    for url in (u.strip() for item in items for u in item.split(",")):
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ConfigurationError(f"a replica URL must be http(s)://host:port, got {url!r}; give each vLLM "
                                     "server's address (e.g. http://10.0.0.5:8000)")
        url = url.rstrip("/").removesuffix("/v1")
        if url not in found:
            found.append(url)
    if not found:
        raise ConfigurationError(f"no replica URL in {shown(urls)}; give at least one vLLM server's address")
    return tuple(found)


def from_gateway(url: str, *, token: str | None = None, timeout: float = 30.0) -> tuple[str, ...]:
    """The replica set a ``lightning-rl gateway`` routes to (its ``GET /v1/upstreams``, with its token): the
    servers a publish must reach. A URL that is not a gateway is a PublishError naming it."""
    base = replica_urls(url)[0]
    text = _request(f"{base}/v1/upstreams", None, timeout, token=token)
    try:
        upstreams = json.loads(text)["upstreams"]
    except (ValueError, TypeError, KeyError):
        raise PublishError(f"{base}/v1/upstreams did not answer as a lightning-rl gateway (got {text[:80]!r}); give "
                           "the gateway's address (http://host:port of `lightning-rl gateway`)") from None
    return replica_urls(upstreams)


def _request(url: str, body: dict[str, Any] | None, timeout: float, *, token: str | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300].replace("\n", " ")
        raise PublishError(f"{url} answered {exc.code}: {detail}") from None
    except OSError as exc:
        raise PublishError(f"cannot reach {url}: {exc}; is the vLLM server running with --enable-lora?") from None


def _unload(url: str, name: str) -> None:
    _request(f"{url}/v1/unload_lora_adapter", {"lora_name": name}, 30.0)


class Replicas:
    """The vLLM servers that serve a policy (module doc). ``retries``: further tries of a replica whose
    load failed, ``backoff`` seconds apart (doubling); ``keep``: versioned names kept loaded."""

    def __init__(self, urls: str | Sequence[str] | Replicas, *, retries: int = 3, backoff: float = 0.5,
                 keep: int = 3, timeout: float = 120.0) -> None:
        if isinstance(urls, Replicas):
            urls = urls.urls
        self.urls = replica_urls(urls)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"retries must be an int >= 0, got {shown(retries)}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigurationError(f"keep must be an int >= 1 (the live versioned name stays), got {shown(keep)}")
        self.retries, self.backoff, self.keep, self.timeout = retries, backoff, keep, timeout

    def __repr__(self) -> str:
        return f"Replicas({list(self.urls)!r})"

    def __len__(self) -> int:
        return len(self.urls)

    # -- one replica -----------------------------------------------------------------------------
    def models(self, url: str, *, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        """What the replica at ``url`` serves (``/v1/models``), by name. A URL that does not answer as a
        vLLM OpenAI server is a :class:`PublishError` naming it."""
        text = _request(f"{url}/v1/models", None, timeout)
        try:
            listed = json.loads(text).get("data")
            models = {m["id"]: m for m in listed}
        except (ValueError, AttributeError, TypeError, KeyError):
            raise PublishError(f"{url}/v1/models did not answer as a vLLM OpenAI server (got {text[:80]!r}); give "
                               "the replica's address (http://host:port of `vllm serve`)") from None
        return models

    def _load_one(self, url: str, name: str, adapter: str) -> None:
        """Load ``adapter`` under ``name`` on one replica (in place: a retry or a reload is harmless),
        retried with back-off; raises the last PublishError."""
        wait = self.backoff
        for attempt in range(self.retries + 1):
            try:
                _request(f"{url}/v1/load_lora_adapter",
                         {"lora_name": name, "lora_path": adapter, "load_inplace": True}, self.timeout)
                return
            except PublishError as exc:
                if " 404:" in str(exc) and re.search(r'"detail":\s*"Not Found"', str(exc)):
                    # the route itself is missing (the framework's 404), not an adapter vLLM could not read
                    raise PublishError(f"replica {url} has no /v1/load_lora_adapter route ({exc}): start vLLM with "
                                       "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or give the address "
                                       "of a vLLM server)") from None
                if attempt == self.retries:
                    if " 404:" in str(exc):
                        raise PublishError(f"replica {url} cannot read the adapter {adapter} ({exc}); every replica "
                                           "loads it from that path: put the adapter folder on a filesystem every "
                                           "replica host mounts at the same path") from None
                    raise PublishError(f"replica {url} did not load {name!r} after {attempt + 1} tries: {exc}") from None
                count("replica_load_retries")
                log.warning("lightning-rl: replica %s did not load %r (try %d of %d): %s; trying again in %.1fs",
                            url, name, attempt + 1, self.retries + 1, exc, wait)
                time.sleep(wait)
                wait *= 2

    def _each(self, urls: Sequence[str], fn: Callable[[str], None]) -> dict[str, PublishError]:
        """``fn(url)`` on every replica at once; the replicas that failed, with their errors."""
        failed: dict[str, PublishError] = {}

        def one(url: str) -> None:
            try:
                fn(url)
            except PublishError as exc:
                failed[url] = exc

        if len(urls) == 1:
            one(urls[0])
        else:
            with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="lightning-rl-replica") as pool:
                list(pool.map(one, urls))
        return failed

    # -- the set ---------------------------------------------------------------------------------
    def load(self, name: str, adapter: str | Path) -> None:
        """Load ``adapter`` under ``name`` on every replica (the gate's candidate, a canary, a rollback's
        stable name); raises a PublishError naming each replica that failed after its retries."""
        failed = self._each(self.urls, lambda url: self._load_one(url, name, str(adapter)))
        if failed:
            count("replica_publish_failures")
            raise PublishError("; ".join(str(e) for e in failed.values()))

    def unload(self, name: str) -> dict[str, PublishError]:
        """Unload ``name`` from every replica (best effort); returns the replicas that refused."""
        return self._each(self.urls, lambda url: _unload(url, name))

    def publish(self, served_name: str, version: int, adapter: str | Path) -> str:
        """Make ``version`` live on every replica (module doc, steps 1-3); returns its versioned name."""
        adapter, name = str(adapter), versioned_name(served_name, version)
        started = time.monotonic()
        failed = self._each(self.urls, lambda url: self._load_one(url, name, adapter))
        if failed:
            took = [u for u in self.urls if u not in failed]
            if took:
                Replicas(took, retries=0).unload(name)
            count("replica_publish_failures")
            raise PublishError(f"version {version} of {served_name!r} was not published (no replica serves it, "
                               f"nothing recorded): " + "; ".join(str(e) for e in failed.values()))
        loaded = time.monotonic()
        for url, exc in self._each(self.urls, lambda url: self._load_one(url, served_name, adapter)).items():
            count("replica_stable_load_failures")
            report_failure(f"replica {url}: in-place load", exc, message=(
                f"lightning-rl: replica {url} serves {name!r} but did not load it in place under {served_name!r} "
                f"({exc}); traced calls are not affected, untraced ones to {served_name!r} there get the previous "
                "version until `lightning-rl policies sync` (or the continuous trainer) reconciles it (counted)"))
        self.prune(served_name, version)
        log.info("lightning-rl: %s live on %d replica(s) in %.2fs (%.2fs versioned)", name, len(self.urls),
                 time.monotonic() - started, loaded - started)
        return name

    def prune(self, served_name: str, version: int) -> None:
        """Unload the versioned names of ``served_name`` at or below ``version - keep`` (module doc, step 3)."""
        def one(url: str) -> None:
            try:
                names = self.models(url)
            except PublishError as exc:
                report_failure(f"replica {url}: listing models", exc)
                return
            for name in names:
                old = _version_of(name, served_name)
                if old is not None and old <= version - self.keep:
                    try:
                        _unload(url, name)
                    except PublishError as exc:
                        report_failure(f"replica {url}: unloading an old version", exc)
        self._each(self.urls, one)

    def check_served(self, names: Sequence[str]) -> None:
        """Every name in ``names`` is served as an adapter by every replica; a ConfigurationError names the
        replica and the name otherwise."""
        for url in self.urls:
            listed = self.models(url)
            for name in names:
                model = listed.get(name)
                if model is None:
                    raise ConfigurationError(f"the replica {url} does not serve {name!r} (it serves {sorted(listed)}); "
                                             f"start vLLM with --enable-lora --max-loras {len(names)}")
                if "parent" in model and model["parent"] is None:
                    raise ConfigurationError(f"{name!r} is the base model's own name on {url}; give the policy "
                                             "another served name (its LoRA is loaded under it)")

    def reconcile(self, live: Any, *, also: dict[str, str] | None = None) -> dict[str, list[str]]:
        """Load the live publish ``live`` (a ``PolicyRecord``, or None) on every replica that lacks it: its
        versioned name (``served_as``) where missing, and the stable name where missing or serving another
        folder; likewise each name of ``also`` (name -> adapter folder: a canary's candidate). Returns the
        names loaded, by replica (empty: every replica was right). A replica that cannot be listed or
        refuses a load raises a PublishError naming it (the others are done first)."""
        done: dict[str, list[str]] = {}
        wanted: dict[str, str] = dict(also or {})
        if live is not None and live.adapter is not None:
            wanted[live.served_name] = live.adapter
            if getattr(live, "served_as", None):
                wanted[live.served_as] = live.adapter
        if not wanted:
            return done

        def one(url: str) -> None:
            models = self.models(url)
            loaded: list[str] = []
            for name, adapter in wanted.items():
                if models.get(name, {}).get("root") != adapter:
                    self._load_one(url, name, adapter)
                    loaded.append(name)
            if loaded:
                count("replica_reconciled_loads", len(loaded))
                log.warning("lightning-rl: replica %s lacked %s; loaded them", url, loaded)
                done[url] = loaded

        failed = self._each(self.urls, one)
        if failed:
            raise PublishError("; ".join(str(e) for e in failed.values()))
        return done


def sync(store: Any, server_url: str | Sequence[str] | Replicas, served_name: str = "policy") -> dict[str, Any]:
    """Reconcile every replica with the live publish of ``served_name`` in ``store`` (``lightning-rl policies
    sync``): returns ``{"served_name", "version", "served_as", "loaded": {replica: [names]}}``."""
    replicas = Replicas(server_url)
    live = store.latest_policies().get(served_name)
    if live is None:
        names = sorted(store.latest_policies())
        raise ConfigurationError(f"the store {getattr(store, 'url', store)} holds no publish of {served_name!r} (it "
                                 f"holds {names}); give the policy's served name with --served-name")
    if live.adapter is None or not (Path(live.adapter) / "adapter_config.json").is_file():
        raise ConfigurationError(f"the live version {live.version} of {served_name!r} has no adapter folder at "
                                 f"{live.adapter!r} here; run sync where the trainer's adapters are (the path every "
                                 "replica reads)")
    loaded = replicas.reconcile(live)
    return {"served_name": served_name, "version": live.version, "served_as": getattr(live, "served_as", None),
            "loaded": loaded}
