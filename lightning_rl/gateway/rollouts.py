"""The gateway's rollouts: opened over HTTP (or adopted from a traced function of this process, for
``lrl.command``), each with a key; rewards, the finish, the idle and orphan sweeps; and the spans an
agent's OpenTelemetry SDK sends to them (OTLP in, decoded by ``otlp.py``)."""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import semconv
from ..boundaries import INT64_MAX, is_int, json_problem, safe_text
from ..diagnostics import count, report_failure
from ..errors import GatewayError, InvalidRewardError, check_reward
from ..records import Reward, RewardSource, Rollout, RolloutStatus, SpanRow
from ..settings import MODES
from ..store.queries import expire_idle_running
from ..tracer.context import RolloutState, rollout_scope
from ..tracer.provider import tracing
from ..tracer.redaction import redact_row, redact_rollout, redact_text
from .shared import KEY_PREFIX, root_span, rollout_key

ORIGIN = "gateway"  # Rollout.origin of the rollouts opened over the HTTP API


@dataclass(eq=False)
class OpenRollout:
    """A rollout opened over HTTP and not finished yet."""

    rollout: Rollout | None  # None: adopted (a rollout of this process, ended by its @trace)
    state: RolloutState
    span: Any
    key: str
    upstream: str | None = None
    # every call sent to the engine as this model, whatever name the agent asked for (a CLI asking for its
    # vendor's names, e.g. Claude Code's claude-opus-*; set by lrl.command): the name asked is kept on the span
    model: str | None = None
    tool_calls_seen: set[str] = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)  # the last call, reward or span sent to it
    lock: threading.Lock = field(default_factory=threading.Lock)


class Rollouts:
    """Open rollouts and their keys (a part of :class:`~lightning_rl.gateway.proxy.Gateway`, over its state)."""

    rollouts: dict[str, OpenRollout]
    _by_key: dict[str, str]
    idle_timeout: float | None

    def open_rollout(self, body: dict[str, Any], base_url: str) -> dict[str, Any]:
        task = body.get("task")
        mode = body.get("mode") or tracing.settings.mode
        if mode not in MODES:
            raise GatewayError(422, f"mode {mode!r} is not one of {', '.join(MODES)}")
        agent, name = body.get("agent"), body.get("name") or body.get("agent") or "gateway"
        for key, value in (("agent", agent), ("name", name), ("group_id", body.get("group_id")),
                           ("model", body.get("model"))):
            if value is not None and (not isinstance(value, str) or not value):
                raise GatewayError(422, f"{key} must be a non-empty string, got {value!r}")
        if self.shared and body.get("model") is not None:  # the store's rollout record has no place for it
            raise GatewayError(422, "a rollout's own model is not kept across --shared gateways; start each "
                                    "gateway with --model NAME (every call sent as NAME) instead")
        attempt = body.get("attempt", 0)
        if not is_int(attempt) or not 0 <= attempt <= INT64_MAX:
            raise GatewayError(422, f"attempt must be an int from 0 to 2**63-1, got {safe_text(attempt)[:60]}")
        problem = json_problem(task, "task")
        if problem:
            raise GatewayError(422, f"the task cannot be stored: {problem}")
        rollout_id = uuid.uuid4().hex
        group_id = body.get("group_id") or uuid.uuid5(uuid.NAMESPACE_URL, orjson.dumps(
            task, option=orjson.OPT_SORT_KEYS).decode()).hex[:16]
        rollout = Rollout(rollout_id=rollout_id, name=name, agent=agent or name, task=task, group_id=group_id,
                          attempt=attempt, mode=mode, status=RolloutStatus.RUNNING,
                          policy_version=tracing.policy_version(), origin=ORIGIN)
        redact = tracing.redaction()
        self.store.start_rollout(rollout if redact is None else redact_rollout(rollout, redact))
        state = RolloutState(rollout_id, name, agent or name, mode, rollout.policy_version, group_id=group_id,
                             attempt=attempt)
        if self.shared:  # the store holds it (shared.py): any gateway with the token serves its next request
            state.seq = self._seq
            self.rollouts[rollout_id] = OpenRollout(rollout, state, root_span(rollout_id),
                                                    rollout_key(self.token or "", rollout_id),
                                                    upstream=self._rendezvous(rollout_id))
            self._settle()
        else:
            with rollout_scope(state):  # the span processor numbers spans of the active rollout only
                span = tracing.tracer.start_span(f"invoke_agent {rollout.agent}", attributes={
                    semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: rollout.agent,
                    semconv.ROLLOUT_ID: rollout_id, semconv.POLICY_VERSION: rollout.policy_version})
            self.rollouts[rollout_id] = OpenRollout(rollout, state, span, KEY_PREFIX + secrets.token_urlsafe(24),
                                                    model=body.get("model"))
            self._by_key[self.rollouts[rollout_id].key] = rollout_id
        key = self.rollouts[rollout_id].key
        count("gateway_rollouts_opened")
        return {"rollout_id": rollout_id, "base_url": f"{base_url.rstrip('/')}/rollouts/{rollout_id}/v1",
                "api_key": key, "group_id": group_id}

    def adopt(self, state: RolloutState, span: Any, base_url: str, model: str | None = None) -> dict[str, Any]:
        """Route calls to a rollout of this process (``command``): a key and a base URL for it. The
        rollout is ended by its own ``@trace``, not over HTTP; ``release`` forgets the key. ``model``:
        every call goes to the engine as this model, whatever name it asked for."""
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        self.rollouts[state.rollout_id] = OpenRollout(None, state, span, key, model=model)
        self._by_key[key] = state.rollout_id
        return {"rollout_id": state.rollout_id, "base_url": f"{base_url.rstrip('/')}/rollouts/{state.rollout_id}/v1",
                "api_key": key}

    def release(self, rollout_id: str) -> None:
        active = self.rollouts.pop(rollout_id, None)
        if active is not None:
            self._by_key.pop(active.key, None)

    def reward(self, rollout_id: str, body: dict[str, Any], headers: Any) -> dict[str, Any]:
        name = body.get("name", "reward")
        if not isinstance(name, str) or not name:
            raise GatewayError(422, f"name must be a non-empty string, got {name!r}")
        try:
            value = check_reward(body.get("value"), what=f"reward {name!r}")
        except InvalidRewardError as exc:
            raise GatewayError(422, str(exc)) from None
        given = self._bearer(headers)
        if self._key_owner(given) not in (None, rollout_id):
            raise GatewayError(403, "this key belongs to another rollout; a rollout key writes only its own rollout")
        active = self._open_now(rollout_id)
        if active is None:  # late feedback on a finished rollout: needs the gateway's token, not a key
            self.check_admin(headers)  # before anything tells whether the rollout exists
            if not self._finished(rollout_id):
                raise GatewayError(404, f"unknown rollout {rollout_id!r}")
            self.store.add_reward(rollout_id, value, name=name)
            self._settle()
            return {"rollout_id": rollout_id, "late": True}
        self.rollout_for(rollout_id, headers)
        index = active.state.last_llm_call
        self.store.write_reward(Reward(rollout_id=rollout_id, value=value, name=name, llm_call_index=index,
                                       source=RewardSource.EMITTED))
        self._settle()
        return {"rollout_id": rollout_id, "late": False, "llm_call_index": index}

    def finish(self, rollout_id: str, body: dict[str, Any], headers: Any) -> dict[str, Any]:
        active = self.rollout_for(rollout_id, headers)
        if active.rollout is None:
            raise GatewayError(409, f"rollout {rollout_id!r} is a command's (lrl.command): it ends when the command "
                                    "exits, with the reward on its last line of output or sent to the rewards route")
        status = body.get("status", "succeeded")
        if status not in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.TIMED_OUT):
            raise GatewayError(422, f"status must be 'succeeded', 'failed' or 'timed_out', got {status!r}")
        error = body.get("error")
        if error is not None and not isinstance(error, str):
            raise GatewayError(422, f"error must be a string, got {error!r}")
        reward = body.get("reward")
        if reward is not None:
            try:
                reward = check_reward(reward, what="the rollout's reward")
            except InvalidRewardError as exc:
                raise GatewayError(422, str(exc)) from None
        if not self._end(active, status, error, reward):
            raise GatewayError(409, f"rollout {rollout_id!r} has finished")
        return {"rollout_id": rollout_id, "status": status}

    def _end(self, active: OpenRollout, status: str, error: str | None, reward: float | None = None) -> bool:
        """End an HTTP-opened rollout (once: False if it had ended already)."""
        rollout_id = active.state.rollout_id
        with active.lock:
            if self.rollouts.pop(rollout_id, None) is None:
                return False
        self._by_key.pop(active.key, None)
        if reward is not None:
            self.store.write_reward(Reward(rollout_id=rollout_id, value=reward, source=RewardSource.RETURNED))
        for call in list(active.state.open_calls.values()):  # streams the agent never finished reading
            call.finish(incomplete=True)
        version = active.state.oldest_call_version
        if self.shared:  # the root span, and the versions of calls other gateways made, from the store
            try:
                version = self._write_root(active, status, error)
            except Exception as exc:  # the end is recorded all the same
                report_failure("gateway shared rollout root span", exc)
            active.state.note_end()
        else:
            try:
                if status != RolloutStatus.SUCCEEDED:
                    from opentelemetry.trace import Status, StatusCode

                    active.span.set_status(Status(StatusCode.ERROR, error or status))
                active.span.end()
            except Exception as exc:
                report_failure("gateway rollout span end", exc)
            active.state.note_end()
        self.store.finish_rollout(rollout_id, RolloutStatus(status), time.time(),
                                  redact_text(error, tracing.redaction()), version)
        self.store.flush(tracing.settings.flush_timeout)
        return True

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End, as timed out, the HTTP-opened rollouts that nothing reached for ``idle_timeout`` seconds
        (an agent that died without finishing): otherwise they would read "running" for ever. A call
        still streaming counts as activity. Returns their ids."""
        if self.idle_timeout is None:
            return []
        now = time.monotonic() if now is None else now
        if self.shared:  # another gateway may be serving it: forget it here; the orphan sweep reads the store
            for active in list(self.rollouts.values()):
                if active.rollout is not None and not active.state.open_calls \
                        and now - active.last_seen >= self.idle_timeout:
                    self.rollouts.pop(active.state.rollout_id, None)
            return []
        ended = []
        for active in list(self.rollouts.values()):
            if active.rollout is None or active.state.open_calls or now - active.last_seen < self.idle_timeout:
                continue  # a command's rollout ends with its process
            if self._end(active, RolloutStatus.TIMED_OUT, f"no call, reward or finish reached the gateway for "
                                                          f"{self.idle_timeout:g} s (its idle timeout); the agent "
                                                          "probably stopped without finishing its rollout"):
                ended.append(active.state.rollout_id)
        if ended:
            count("gateway_rollouts_timed_out", len(ended))
        return ended

    def expire_orphans(self, now: float | None = None) -> list[str]:
        """End, as timed out, the store's gateway-opened rollouts that no live gateway holds and nothing
        reached for ``idle_timeout`` seconds: a gateway killed outright (no graceful stop) leaves its
        rollouts running, and their keys died with it. Safe beside other gateways on the same store: a
        rollout a live gateway holds gets a span or a reward within the idle timeout, or that gateway
        ends it itself. Runs when the gateway starts and with each idle sweep."""
        if self.idle_timeout is None:
            return []
        ended = expire_idle_running(self.store, self.idle_timeout, origin=ORIGIN, keep=set(self.rollouts), now=now)
        if ended:
            count("gateway_orphans_timed_out", len(ended))
        return ended

    def end_all(self, why: str) -> list[str]:
        """End every HTTP-opened rollout still open as failed (the gateway is stopping: their keys die with it).
        Shared: none (the other gateways serve them); what was written is flushed."""
        if self.shared:
            self._settle()
            return []
        ended = [a.state.rollout_id for a in list(self.rollouts.values())
                 if a.rollout is not None and self._end(a, RolloutStatus.FAILED, why)]
        if ended:
            count("gateway_rollouts_ended_on_stop", len(ended))
        return ended


    # -- OTLP in -------------------------------------------------------------------------------------
    def take_spans(self, spans: list[dict[str, Any]], rollout_id: str | None, headers: Any) -> dict[str, Any]:
        """Spans from an agent's OpenTelemetry SDK (``otlp.decode``) into their rollouts: the one named by
        the span's or its resource's ``lightning_rl.rollout.id``, else by the request (path or key).
        LLM-call spans are not stored (the gateway records calls itself, with the engine's ids); spans
        of no open rollout, or of one the request's key does not open, are refused. Both are counted and
        said in the answer (OTLP's partial success)."""
        key_rollout = self.check_spans_sender(rollout_id, headers)
        stored, why, held = 0, {}, {}
        for span in spans:
            target = span["attributes"].get(semconv.ROLLOUT_ID) or rollout_id or key_rollout
            if isinstance(target, str) and target not in held:
                held[target] = self._open_now(target)
            active = held.get(target) if isinstance(target, str) else None
            reason = None
            if active is None:
                reason = "no open rollout named (lightning_rl.rollout.id, the path or the key)"
            elif key_rollout is not None and target != key_rollout:
                reason = "a rollout key writes only its own rollout"
            elif span["attributes"].get(semconv.GEN_AI_OPERATION_NAME) in semconv.LLM_OPERATIONS:
                reason = "LLM-call spans are recorded by the gateway itself, with the engine's token ids"
            if reason is not None:
                why[reason] = why.get(reason, 0) + 1
                continue
            self._write_external(active, span)
            stored += 1
        if stored:
            self._settle()
        rejected = sum(why.values())
        if rejected:
            count("gateway_otlp_spans_refused", rejected)
        return {"stored": stored, "rejected": rejected,
                "message": "; ".join(f"{n} span(s): {reason}" for reason, n in why.items())}

    def _write_external(self, active: OpenRollout, span: dict[str, Any]) -> None:
        active.last_seen = time.monotonic()
        attributes = dict(span["attributes"])
        attributes[semconv.ROLLOUT_ID] = active.state.rollout_id
        if semconv.GEN_AI_OPERATION_NAME not in attributes:  # a tool's span, else an agent's step
            attributes[semconv.GEN_AI_OPERATION_NAME] = (
                semconv.OP_EXECUTE_TOOL if semconv.GEN_AI_TOOL_NAME in attributes else semconv.OP_INVOKE_AGENT)
        root = active.span.get_span_context()
        # The agent's own tree is kept (a child usually arrives before its parent, which ends later); its
        # top spans hang under the rollout's root, and every span joins the rollout's trace.
        row = SpanRow(
            active.state.rollout_id, next(active.state.seq), root.trace_id, span["span_id"],
            span["parent_id"] or root.span_id, span["name"], span["kind"], span["start_ns"], span["end_ns"],
            span["status_code"], span["status_message"], attributes, span["events"])
        redact = tracing.redaction()  # the agent's own spans: its tool results, its errors
        self.store.write_span(row if redact is None else redact_row(row, redact, tracing.keep_redacted_tokens()))
