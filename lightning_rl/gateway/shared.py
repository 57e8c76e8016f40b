"""Rollouts shared by gateways behind one plain balancer (``Gateway(shared=True)``, ``--shared``).

A gateway alone holds an open rollout in its memory. With ``shared``, nothing a rollout's next request
needs lives only in one gateway: the store holds it, and each gateway keeps what it read as a cache.

* **The key** is derived from the rollout id and the gateways' token (an HMAC), so every gateway that
  shares the token checks it without asking anyone: ``lrl-<rollout id>.<mac>``. To the agent it is the
  same opaque bearer key, scoped to its rollout. Rotating the token ends the keys of open rollouts.
* **The rollout** (task, mode, agent, group, attempt, version) is the store's record, read once per
  request: a rollout another gateway finished answers 409 everywhere.
* **The call index** of a new call is the number of calls the store holds for the rollout
  (``llm_call_counts``, a count that reads no tokens), read once per call; a reward goes on the latest.
* **The span sequence** (``seq``, the order the store keeps a rollout's spans in, and with the rollout id
  its idempotency key) is the microsecond clock with 8 random bits for this gateway process: unique and
  in order across gateways without a round trip, given clocks kept in sync (NTP), as leases need.
* **The root span** (``invoke_agent``) has a trace and span id derived from the rollout id, and is
  written by the gateway that ends the rollout, from the rollout's start time.
* **Tool spans** come from the tool messages after the conversation's last assistant message (the
  ones the earlier calls could not have seen), so a call on another gateway does not repeat them.
* **Nothing is answered before it is stored**: every request that wrote (an open, a call, a reward,
  spans, a finish) flushes the store before the answer goes out, so the agent's next request, on any
  gateway, finds it; and a gateway killed outright loses only a call whose answer never reached the agent.
* **The engine** a rollout's calls go to is chosen by rendezvous hashing of the rollout id over the
  engines up, so every gateway sends a rollout to the same engine (its prefix cache).

Concurrent calls of one rollout through different gateways may be given the same call index (both are
recorded, neither is lost); an agent's calls of one rollout are one after the other in practice.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import secrets
import threading
import time
from typing import Any

from .. import semconv
from ..diagnostics import count
from ..errors import ConfigurationError, GatewayError
from ..records import RolloutStatus, SpanRow

KEY_PREFIX = "lrl-"
_KEY_LABEL = b"lightning-rl gateway rollout key\0"


def check_shared(shared: bool, token: str | None) -> None:
    if shared and not token:
        raise ConfigurationError("--shared needs --token (the same on every gateway behind the balancer): a "
                                 "rollout's key is derived from it, so that any of them can check it")


def rollout_key(secret: str, rollout_id: str) -> str:
    """The key of ``rollout_id``, the same on every gateway holding ``secret``."""
    mac = hmac.new(secret.encode(), _KEY_LABEL + rollout_id.encode(), hashlib.sha256).digest()
    return f"{KEY_PREFIX}{rollout_id}.{base64.urlsafe_b64encode(mac[:24]).decode()}"


def key_owner(secret: str, key: str) -> str | None:
    """The rollout ``key`` opens, or None when it is not a key these gateways made."""
    rollout_id, dot, _ = key[len(KEY_PREFIX):].rpartition(".")
    if not dot or not rollout_id:
        return None
    return rollout_id if hmac.compare_digest(rollout_key(secret, rollout_id).encode(), key.encode()) else None


def root_ids(rollout_id: str) -> tuple[int, int]:
    """The trace id and root span id of a shared rollout, the same on every gateway."""
    digest = hashlib.sha256(b"lightning-rl rollout\0" + rollout_id.encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def root_span(rollout_id: str) -> Any:
    """A stand-in for the rollout's root span: the parent of its calls' spans (written at the end)."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id = root_ids(rollout_id)
    return NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(1)))


class ClockSeq:
    """Span sequence numbers unique across gateways: ``(microseconds << 8) | lane``, strictly increasing in
    this process; ``lane``: 8 random bits per gateway process. An iterator, as ``RolloutState.seq``."""

    def __init__(self) -> None:
        self.lane = secrets.randbelow(256)
        self._last = 0
        self._lock = threading.Lock()

    def at(self, seconds: float) -> int:
        return (int(seconds * 1e6) << 8) | self.lane

    def __iter__(self) -> "ClockSeq":
        return self

    def __next__(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns() // 1000)
            return (self._last << 8) | self.lane


def new_tool_messages(messages: Any) -> set[str]:
    """Tool call ids answered before the conversation's last assistant message: earlier calls saw them."""
    if not isinstance(messages, list):
        return set()
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
               default=-1)
    return {m["tool_call_id"] for m in messages[:last]
            if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str)}


class Shared:
    """The shared mode's store reads and writes (a part of :class:`~lightning_rl.gateway.proxy.Gateway`)."""

    shared: bool
    token: str | None
    upstreams: list[str]
    rollouts: dict[str, Any]
    _seq: ClockSeq

    def _key_owner(self, given: str | None) -> str | None:
        """The rollout a bearer key opens (None: not a rollout key, or not one of ours)."""
        if not given or not given.startswith(KEY_PREFIX):
            return None
        owner = self._by_key.get(given)  # an adopted rollout's (``command``), or any when not shared
        if owner is None and self.shared:
            owner = key_owner(self.token or "", given)
        return owner

    def _open_now(self, rollout_id: str) -> Any:
        """The open rollout ``rollout_id`` (shared: as the store has it now), or None (unknown, finished)."""
        active = self.rollouts.get(rollout_id)
        if not self.shared or (active is not None and active.rollout is None):
            return active
        try:
            return self._load_shared(rollout_id)
        except GatewayError:
            return None

    def _load_shared(self, rollout_id: str) -> Any:
        """The open rollout ``rollout_id`` as the store has it now (cached here, its counters refreshed);
        None if the store has no open gateway rollout of that id. Raises 409 if it has finished."""
        from .rollouts import ORIGIN, OpenRollout

        try:
            rollout = self.store.get_rollout(rollout_id)
        except KeyError:
            self.rollouts.pop(rollout_id, None)
            return None
        if rollout.origin != ORIGIN:
            return None
        if rollout.status.finished:
            self.rollouts.pop(rollout_id, None)
            raise GatewayError(409, f"rollout {rollout_id!r} has finished; open a new one for more calls")
        active = self.rollouts.get(rollout_id)
        if active is None:
            from ..tracer.context import RolloutState

            state = RolloutState(rollout_id, rollout.name, rollout.agent, rollout.mode, rollout.policy_version,
                                 group_id=rollout.group_id, attempt=rollout.attempt, seq=self._seq)
            active = OpenRollout(rollout, state, root_span(rollout_id), rollout_key(self.token or "", rollout_id),
                                 upstream=self._rendezvous(rollout_id))
            active = self.rollouts.setdefault(rollout_id, active)
            count("gateway_shared_rollouts_loaded")
        n = self.store.llm_call_counts([rollout_id]).get(rollout_id, 0)
        state = active.state
        with state.lock:
            if not state.open_calls:  # a stream of this gateway still running: its own counter holds
                state.llm_call_counter = itertools.count(n)
                state.llm_calls = n
                state.last_llm_call = n - 1 if n else None
        return active

    def _rendezvous(self, rollout_id: str) -> str:
        """The engine every gateway picks for ``rollout_id`` (highest hash of rollout and engine)."""
        return max(self.upstreams, key=lambda u: hashlib.sha256(f"{rollout_id}\0{u}".encode()).digest())

    def _settle(self) -> None:
        """Shared mode: what this request wrote is in the store before the answer goes out."""
        if self.shared:
            from ..tracer.provider import tracing

            if not self.store.flush(tracing.settings.flush_timeout):
                count("gateway_shared_flush_timeouts")

    def _write_root(self, active: Any, status: str, error: str | None) -> int | None:
        """Shared mode: the rollout's root span, written by the gateway that ends it; returns the oldest
        policy version its calls were stamped with (from the store: other gateways made some of them)."""
        from ..tracer.provider import tracing
        from ..tracer.redaction import redact_text

        rollout, rollout_id = active.rollout, active.state.rollout_id
        self._settle()
        versions = [s.attributes.get(semconv.POLICY_VERSION) for s in self.store.spans(rollout_id)
                    if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) in semconv.LLM_OPERATIONS]
        versions = [v for v in versions if isinstance(v, int)]
        trace_id, span_id = root_ids(rollout_id)
        attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                      semconv.GEN_AI_AGENT_NAME: rollout.agent, semconv.ROLLOUT_ID: rollout_id}
        if rollout.policy_version is not None:
            attributes[semconv.POLICY_VERSION] = rollout.policy_version
        failed = status != RolloutStatus.SUCCEEDED
        self.store.write_span(SpanRow(
            rollout_id, self._seq.at(rollout.start_time), trace_id, span_id, None, f"invoke_agent {rollout.agent}",
            "INTERNAL", int(rollout.start_time * 1e9), time.time_ns(), "ERROR" if failed else "UNSET",
            redact_text(error or status, tracing.redaction()) if failed else None, attributes, ()))
        return min(versions) if versions else None
