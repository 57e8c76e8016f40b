"""Policy versions and canary routing: which version a traced call is stamped with, and where it goes.

A version set in this process (its own publish, :meth:`PolicyVersions.set`) holds until the store records a
later publish of that name; every process reads the store's publishes, so runner processes, Ray actors and
agents behind the gateway stamp the same versions as the trainer that published them. The canaries in
progress (``canary.py``) are read with the publishes.

What is read from the store is named by one protocol, :class:`PolicyLogReader` (the two reads of the store's
``PolicyLog``, which every store implements); a sink that is not one (a test's, a user's own) stamps only the
versions set in this process. The reads run in the background at most every ``policy_refresh`` seconds
(``LIGHTNING_RL_POLICY_REFRESH``); only the first read in a process waits, and for at most half a second.
Nothing here raises into the agent: a read that fails is counted, logged once and tried again later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from ..boundaries import check_int
from ..diagnostics import count, report_failure
from ..settings import Settings
from ..sink import SpanSink
from .canary import Canary, canaries_from

__all__ = ["PolicyLogReader", "PolicyVersions"]


@runtime_checkable
class PolicyLogReader(Protocol):
    """The store abilities the policy versions read (``store/protocols.py`` ``PolicyLog`` has both)."""

    def latest_policies(self) -> Mapping[str, Any]:
        """The latest publish of each served name: ``.version``, ``.time``, ``.served_as``."""
        ...

    def latest_decisions(self) -> Mapping[str, Any]:
        """The latest decision about each served name (a ``canary`` one routes production calls)."""
        ...


class PolicyVersions:
    """This process's view of the policy versions and canaries: its own publishes and the store's."""

    def __init__(self, settings: Settings, get_sink: Callable[[], SpanSink | None]) -> None:
        self._settings = settings
        self._get_sink = get_sink
        self._lock = threading.Lock()
        self._refreshing: threading.Thread | None = None
        self.reset(settings.policy_version)

    def reset(self, default: int = 0) -> None:
        """Forget every version this process set or read (tests; a new run in the same process)."""
        with self._lock:
            # name -> version set here; None is the default for names never published
            self._local: dict[str | None, int] = {None: default}
            self._set_at: dict[str | None, float] = {}
            # name -> (its versioned name, version) as this process published it; one tuple: atomic
            self._served_as: dict[str | None, tuple[str, int] | None] = {}
            self._canaries: dict[str, Canary] = {}  # the candidates on canary, by the live name (canary.py)
            self.forget_store()

    def forget_store(self) -> None:
        """Drop what was read from the store (another store is in use now: its publishes are not this one's)."""
        # the store's latest publish of each name: (version, time, served_as: its versioned name or None)
        self._published: dict[str, tuple[int, float, str | None]] = {}
        self._published_at = float("-inf")
        self._reader: tuple[object, bool] = (None, False)  # the sink last looked at, and whether it is a reader

    def set(self, version: int, model: str | None = None, *, served_as: str | None = None) -> None:
        """``model`` answers with ``version`` from now on in this process; ``served_as``: the versioned name
        every replica serves it under (traced calls are sent there, :meth:`served_as`)."""
        check_int(version, "policy version")
        self._served_as[model] = None if served_as is None else (served_as, version)
        self._local[model] = version
        self._set_at[model] = time.time()

    def forget(self, model: str) -> None:
        """Forget what this process set for ``model``: the store's publishes (or the default) hold again."""
        self._local.pop(model, None)
        self._set_at.pop(model, None)
        self._served_as.pop(model, None)

    def own(self, model: str | None) -> int | None:
        """The version this process set for ``model`` itself, or None."""
        return self._local.get(model) if model is not None else None

    def version(self, model: str | None = None) -> int:
        """The version ``model`` (a served name) answers with, as this process knows it now. With no
        name: the only served name's version when exactly one is known, else the default."""
        published = self._store_versions()
        local = self._local
        if model is None:
            names = {n for n in (*local, *published) if n is not None}
            if len(names) != 1:
                return local[None]
            model = names.pop()
        if model in published and published[model][1] >= self._set_at.get(model, 0.0):
            return published[model][0]
        return local.get(model, local[None])

    def served_as(self, model: Any) -> tuple[str, int] | None:
        """Where a traced call for ``model`` (a served name) goes instead, and the version it is stamped with:
        the live publish's versioned name when it has one (``trainer_bridge/replicas.py``: every replica
        serves it, so the version is the one that answers), else None (the call goes as asked). The same
        rule as :meth:`version` picks between this process's own publish and the store's."""
        if not isinstance(model, str):
            return None
        published = self._store_versions().get(model)
        if published is not None and published[1] >= self._set_at.get(model, 0.0):
            return None if published[2] is None else (published[2], published[0])
        return self._served_as.get(model)

    def canary(self, mode: Any, rollout_id: str, model: Any) -> Canary | None:
        """The candidate a production rollout's call to ``model`` goes to instead (``canary.py``), or None."""
        if mode != "prod" or not isinstance(model, str):
            return None
        self._store_versions()  # refreshed with the publishes
        canary = self._canaries.get(model)
        if canary is None or time.time() >= canary.until or not canary.routes(rollout_id):
            return None
        count("llm_calls_routed_to_canary")
        return canary

    def _store_versions(self) -> dict[str, tuple[int, float, str | None]]:
        """The store's publishes, refreshed in the background (module doc). A read is asked for at most once
        an interval, whether the last one came back or not: a read in flight (a reading thread that waits for
        the GIL the agent holds, or for a locked store) is not looked at again by every call meanwhile."""
        now = time.monotonic()
        first = self._published_at
        if now - first < self._settings.policy_refresh:
            return self._published
        self._published_at = now  # asked: the next look is an interval from now
        sink = self._get_sink()
        known = self._reader
        if known[0] is not sink:  # a Protocol isinstance costs microseconds: once a sink, not once an interval
            known = self._reader = (sink, isinstance(sink, PolicyLogReader))
        if not known[1]:  # a sink with no policy log
            return self._published
        try:  # called as a rollout or an LLM call starts: it must never raise into the agent
            with self._lock:
                thread = self._refreshing
                if thread is None or not thread.is_alive():
                    thread = self._refreshing = threading.Thread(
                        target=self._refresh, args=(sink,), name="lightning-rl-policy-versions", daemon=True)
                    thread.start()
            if first == float("-inf"):  # only the first read of a process (or of a store) waits
                thread.join(0.5)
        except Exception as exc:  # tried again after the refresh interval
            report_failure("reading published policy versions", exc)
        return self._published

    def _refresh(self, log: PolicyLogReader) -> None:
        try:
            self._published = {name: (p.version, p.time, getattr(p, "served_as", None))
                               for name, p in log.latest_policies().items()}
        except Exception as exc:
            report_failure("reading published policy versions", exc)
        try:
            self._canaries = canaries_from(log.latest_decisions())
        except Exception as exc:
            report_failure("reading the canaries in progress", exc)
