"""The gateway: trace agents in any language or process (``lightning-rl gateway``).

An HTTP server (uvicorn; FastAPI for its admin routes; a lean keep-alive client to the engines, ``upstream.py``) in front of one or more OpenAI-compatible
engines (vLLM). An agent that cannot import lightning_rl (a Node or Go service, a CLI, a container)
opens a rollout over HTTP and points its OpenAI client at the rollout: every call it makes is
forwarded to an engine and recorded as ``@trace`` records a Python agent's calls, through the same
code (``adapters/openai.LLMCall``): the same spans with the engine's token ids and log-probs, the
same rollouts and rewards, in whatever store the tracer writes to (a SQLite file or the store server).

Routes (JSON bodies; errors in OpenAI's shape, ``{"error": {"message": ..., "code": status, "details": [...]}}``):

* ``POST /v1/rollouts`` ``{task, group_id?, attempt?, mode?, agent?, name?}`` opens a rollout and
  answers ``{rollout_id, base_url, api_key}``. ``base_url`` (``.../rollouts/{id}/v1``) and ``api_key``
  each route a client's calls to the rollout alone, so an unmodified client that lets you set only
  one of them works.
* ``POST .../v1/chat/completions`` and ``POST .../v1/completions``, streamed (SSE) or not, under the
  rollout's base URL, or under ``/v1`` with the rollout's key as the bearer token. The gateway asks
  the engine for token ids and log-probs itself (``return_token_ids``, ``logprobs``) and takes out
  of the answer what the client did not ask for; the rest is what the engine sent. An agent name per
  call: ``.../rollouts/{id}/agents/{agent}/v1/...`` or the ``X-Lightning-RL-Agent`` header.
* ``POST .../v1/messages``: Anthropic Messages, sent to the engine as chat completions and answered
  in the Messages format, streamed or not (``anthropic.py``); the key also as ``x-api-key``.
* ``POST .../v1/responses``: the OpenAI Responses API, the same way (``responses.py``).
* ``POST /v1/traces`` (and under a rollout's path): OTLP/HTTP spans from the agent's own
  OpenTelemetry SDK, added to the rollout they name (``otlp.py``).
* Tool spans come from the conversation itself: a ``tool`` message answering one of the assistant's
  tool calls becomes a tool span (name, call id, arguments, result) the first time a request carries
  it.
* ``POST /v1/rollouts/{id}/rewards`` ``{value, name?}``: a reward, mid-run (on the rollout's latest
  finished call, as ``emit_reward``) or after the end (late feedback).
* ``POST /v1/rollouts/{id}/finish`` ``{status, reward?, error?}``: the end (``succeeded``/``failed``).
* ``GET /v1/health``.

Engines: a rollout's calls stick to one upstream (its prefix cache); a new rollout goes to the
upstream with the fewest calls in flight among those not marked down. An upstream that cannot be
reached is marked down for ``down_for`` seconds and the call goes to the next; a call no upstream can
serve gets 502 and is recorded on the rollout as a failed call. Policy versions are stamped as the
tracer stamps them: from the publishes recorded in the store.

Auth: with a token (required when bound beyond loopback), every route but health needs
``Authorization: Bearer <token>`` (``/openapi.json`` too), except a rollout's own calls, rewards,
finish and spans, which its key also opens; a rollout key opens nothing else. Credentials are checked
before a body is read or decompressed, compare as bytes, and a refused request is answered the same
whether or not the rollout it names exists.

Trust (``boundaries.py``): bodies are read up to ``max_body_bytes`` (also when chunked) and OTLP bodies
decompressed up to the same; integers, nesting and the shapes the assembly reads (messages, tool
calls, span attributes) are checked before anything is forwarded or stored: a request that fails is
answered 4xx naming the field and the limit, and nothing of it is recorded.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import math
import os
import re
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import orjson

from .. import semconv
from ..adapters.openai import LLMCall, _refused_token_fields, _resend_without_token_fields
from ..boundaries import INT64_MAX, header_secret, json_problem, message_problems, safe_text, secret_matches
from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, InvalidRewardError, LightningRLError, check_reward
from ..records import Reward, RewardSource, Rollout, RolloutStatus, SpanRow
from ..settings import MODES
from ..tracer.context import RolloutState, current_rollout, rollout_scope
from ..tracer.decorator import trace
from ..tracer.provider import current_our_span, current_span_of_ours, record_tool_span, tracing
from . import anthropic, otlp, responses
from .upstream import Response as UpstreamResponse
from .upstream import Upstream, UpstreamError

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
except ImportError as exc:  # the gateway is an extra, like the store server
    raise ConfigurationError(
        f"the gateway needs FastAPI and uvicorn ({exc}); install them with: pip install 'lightning-rl[server]'"
    ) from None

DEFAULT_MAX_BODY = 16 * 2**20
AGENT_HEADER = "x-lightning-rl-agent"
_KEY_PREFIX = "lrl-"
ORIGIN = "gateway"  # Rollout.origin of the rollouts opened over the HTTP API
_ENDPOINTS = {"chat/completions": semconv.OP_CHAT, "completions": semconv.OP_TEXT_COMPLETION}


class GatewayError(Exception):
    """A request the gateway refuses: answered with ``status`` and a message naming the fix."""

    def __init__(self, status: int, error: str, details: list[str] | None = None) -> None:
        super().__init__(error)
        self.status, self.error, self.details = status, error, details or []


@dataclass(eq=False)
class OpenRollout:
    """A rollout opened over HTTP and not finished yet."""

    rollout: Rollout | None  # None: adopted (a rollout of this process, ended by its @trace)
    state: RolloutState
    span: Any
    key: str
    upstream: str | None = None
    tool_calls_seen: set[str] = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)  # the last call, reward or span sent to it
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Options:
    """What ``LLMCall`` reads of an openai request's options: the body, and the fields it adds."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.json_data = body
        self.extra_json: dict[str, Any] | None = None


class _Client:
    """What ``LLMCall`` reads of an openai client: the server it talks to."""

    def __init__(self, upstream: str) -> None:
        self.base_url = httpx.URL(upstream)


class _UpstreamStatus(Exception):
    def __init__(self, status_code: int, text: str) -> None:
        super().__init__(f"the engine answered {status_code}: {text[:500]}")
        self.status_code = status_code


def _strip(obj: dict[str, Any], injected: tuple[str, ...]) -> dict[str, Any]:
    """An engine's answer (or stream chunk) less what the gateway asked for and the client did not."""
    if "return_token_ids" in injected:
        obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or ():
        if "return_token_ids" in injected:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if "logprobs" in injected and "logprobs" in choice:
            choice["logprobs"] = None
    return obj


class ChatRenderer:
    """A stream relayed as the engine sent it, less the token fields the client did not ask for."""

    passthrough = True

    def chunk(self, data: dict[str, Any], injected: tuple[str, ...]) -> bytes:
        return b"data: " + orjson.dumps(_strip(data, injected)) + b"\n\n"

    def done(self) -> bytes:
        return b"data: [DONE]\n\n"


class Gateway:
    """The gateway's state: open rollouts, upstreams, and the forwarding (module doc)."""

    def __init__(self, upstreams: list[str], *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
                 down_for: float = 10.0, timeout: float = 600.0, idle_timeout: float | None = 3600.0) -> None:
        if not upstreams:
            raise ConfigurationError("the gateway needs at least one --upstream URL (an OpenAI-compatible engine, "
                                     "e.g. http://127.0.0.1:8000)")
        cleaned = []
        for url in upstreams:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigurationError(f"--upstream must be an http(s):// URL of an OpenAI-compatible server, "
                                         f"got {url!r}")
            cleaned.append(url.rstrip("/").removesuffix("/v1"))
        if idle_timeout is not None and not (isinstance(idle_timeout, (int, float)) and idle_timeout > 0):
            raise ConfigurationError(f"idle_timeout must be a number of seconds > 0 (or None: never), got {idle_timeout!r}")
        self.upstreams = cleaned
        self.token = token
        self.idle_timeout = idle_timeout
        self.max_body_bytes = max_body_bytes
        self.down_for = down_for
        self.timeout = timeout
        self.rollouts: dict[str, OpenRollout] = {}
        self._by_key: dict[str, str] = {}
        self._in_flight = dict.fromkeys(cleaned, 0)
        self._down_until = dict.fromkeys(cleaned, 0.0)
        self._pools: dict[str, Upstream] = {}
        self._clients = {u: _Client(u) for u in cleaned}

    @property
    def store(self) -> Any:
        return tracing.sink()

    # -- auth ----------------------------------------------------------------------------------------
    def _bearer(self, headers: Any) -> str | None:
        """The bearer token, or the ``x-api-key`` header (Anthropic's clients send the key there)."""
        scheme, _, given = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and given.strip():
            return given.strip()
        return (headers.get("x-api-key") or "").strip() or None

    def check_admin(self, headers: Any) -> None:
        """The gateway's own token, where one is set (opening rollouts)."""
        if self.token is None:
            return
        given = self._bearer(headers)
        if not self._is_admin(given):
            raise GatewayError(401, f"{'missing' if given is None else 'wrong'} bearer token; send "
                                    "'Authorization: Bearer <token>' with the gateway's token (--token)")

    def _is_admin(self, given: str | None) -> bool:
        return self.token is None or secret_matches(header_secret(given), self.token)

    def rollout_for(self, rollout_id: str | None, headers: Any) -> OpenRollout:
        """The open rollout a request is for: named by its path, its key, or both (then they agree)."""
        given = self._bearer(headers)
        by_key = self._by_key.get(given) if given and given.startswith(_KEY_PREFIX) else None
        if given and given.startswith(_KEY_PREFIX) and by_key is None:
            raise GatewayError(401, "unknown rollout key; open a rollout with POST /v1/rollouts and use the "
                                    "api_key it answers with (a finished rollout's key no longer works)")
        if rollout_id is None:
            if by_key is None:
                raise GatewayError(401, "no rollout named: call through the rollout's base_url "
                                        "(/rollouts/{id}/v1) or send its api_key as the bearer token")
            rollout_id = by_key
        elif by_key is not None and by_key != rollout_id:
            raise GatewayError(403, f"this key belongs to another rollout than {rollout_id!r}; a rollout key "
                                    "writes only its own rollout")
        elif by_key is None and not self._is_admin(given):
            raise GatewayError(401, "send the rollout's api_key (or the gateway's token) as the bearer token")
        active = self.rollouts.get(rollout_id)
        if active is None:
            if self._finished(rollout_id):
                raise GatewayError(409, f"rollout {rollout_id!r} has finished; open a new one for more calls")
            raise GatewayError(404, f"unknown rollout {rollout_id!r}; open one with POST /v1/rollouts")
        active.last_seen = time.monotonic()
        return active

    def _finished(self, rollout_id: str) -> bool:
        try:
            return self.store.get_rollout(rollout_id).status.finished
        except Exception:
            return False

    # -- rollouts ------------------------------------------------------------------------------------
    def open_rollout(self, body: dict[str, Any], base_url: str) -> dict[str, Any]:
        task = body.get("task")
        mode = body.get("mode") or tracing.settings.mode
        if mode not in MODES:
            raise GatewayError(422, f"mode {mode!r} is not one of {', '.join(MODES)}")
        agent, name = body.get("agent"), body.get("name") or body.get("agent") or "gateway"
        for key, value in (("agent", agent), ("name", name), ("group_id", body.get("group_id"))):
            if value is not None and (not isinstance(value, str) or not value):
                raise GatewayError(422, f"{key} must be a non-empty string, got {value!r}")
        attempt = body.get("attempt", 0)
        if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt <= INT64_MAX:
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
        self.store.start_rollout(rollout)
        state = RolloutState(rollout_id, name, agent or name, mode, rollout.policy_version, group_id=group_id,
                             attempt=attempt)
        with rollout_scope(state):  # the span processor numbers spans of the active rollout only
            span = tracing.tracer.start_span(f"invoke_agent {rollout.agent}", attributes={
                semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: rollout.agent,
                semconv.ROLLOUT_ID: rollout_id, semconv.POLICY_VERSION: rollout.policy_version})
        key = _KEY_PREFIX + secrets.token_urlsafe(24)
        self.rollouts[rollout_id] = OpenRollout(rollout, state, span, key)
        self._by_key[key] = rollout_id
        count("gateway_rollouts_opened")
        return {"rollout_id": rollout_id, "base_url": f"{base_url.rstrip('/')}/rollouts/{rollout_id}/v1",
                "api_key": key, "group_id": group_id}

    def adopt(self, state: RolloutState, span: Any, base_url: str) -> dict[str, Any]:
        """Route calls to a rollout of this process (``command``): a key and a base URL for it. The
        rollout is ended by its own ``@trace``, not over HTTP; ``release`` forgets the key."""
        key = _KEY_PREFIX + secrets.token_urlsafe(24)
        self.rollouts[state.rollout_id] = OpenRollout(None, state, span, key)
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
        if given and given.startswith(_KEY_PREFIX) and self._by_key.get(given) not in (None, rollout_id):
            raise GatewayError(403, "this key belongs to another rollout; a rollout key writes only its own rollout")
        active = self.rollouts.get(rollout_id)
        if active is None:  # late feedback on a finished rollout: needs the gateway's token, not a key
            self.check_admin(headers)  # before anything tells whether the rollout exists
            if not self._finished(rollout_id):
                raise GatewayError(404, f"unknown rollout {rollout_id!r}")
            self.store.add_reward(rollout_id, value, name=name)
            return {"rollout_id": rollout_id, "late": True}
        self.rollout_for(rollout_id, headers)
        index = active.state.last_llm_call
        self.store.write_reward(Reward(rollout_id=rollout_id, value=value, name=name, llm_call_index=index,
                                       source=RewardSource.EMITTED))
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
        try:
            if status != RolloutStatus.SUCCEEDED:
                from opentelemetry.trace import Status, StatusCode

                active.span.set_status(Status(StatusCode.ERROR, error or status))
            active.span.end()
        except Exception as exc:
            report_failure("gateway rollout span end", exc)
        active.state.note_end()
        self.store.finish_rollout(rollout_id, RolloutStatus(status), time.time(), error,
                                  active.state.oldest_call_version)
        self.store.flush(tracing.settings.flush_timeout)
        return True

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End, as timed out, the HTTP-opened rollouts that nothing reached for ``idle_timeout`` seconds
        (an agent that died without finishing): otherwise they would read "running" for ever. A call
        still streaming counts as activity. Returns their ids."""
        if self.idle_timeout is None:
            return []
        now = time.monotonic() if now is None else now
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
        ended = self.store.expire_idle_running(self.idle_timeout, origin=ORIGIN, keep=set(self.rollouts), now=now)
        if ended:
            count("gateway_orphans_timed_out", len(ended))
        return ended

    def end_all(self, why: str) -> list[str]:
        """End every HTTP-opened rollout still open as failed (the gateway is stopping: their keys die with it)."""
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
        stored, why = 0, {}
        for span in spans:
            target = span["attributes"].get(semconv.ROLLOUT_ID) or rollout_id or key_rollout
            active = self.rollouts.get(target) if isinstance(target, str) else None
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
        rejected = sum(why.values())
        if rejected:
            count("gateway_otlp_spans_refused", rejected)
        return {"stored": stored, "rejected": rejected,
                "message": "; ".join(f"{n} span(s): {reason}" for reason, n in why.items())}

    def check_spans_sender(self, rollout_id: str | None, headers: Any) -> str | None:
        """The credentials of an OTLP export, checked before its body is read: the gateway's token, or
        a rollout key (whose rollout is returned). 401 otherwise, whatever the body or path names."""
        given = self._bearer(headers)
        key_rollout = self._by_key.get(given) if given and given.startswith(_KEY_PREFIX) else None
        if given and given.startswith(_KEY_PREFIX) and key_rollout is None:
            raise GatewayError(401, "unknown rollout key; a finished rollout's key no longer works")
        if key_rollout is None and not self._is_admin(given):
            raise GatewayError(401, "send the rollout's api_key (or the gateway's token) as the bearer token")
        if rollout_id is not None:
            self.rollout_for(rollout_id, headers)
        return key_rollout

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
        self.store.write_span(SpanRow(
            active.state.rollout_id, next(active.state.seq), root.trace_id, span["span_id"],
            span["parent_id"] or root.span_id, span["name"], span["kind"], span["start_ns"], span["end_ns"],
            span["status_code"], span["status_message"], attributes, span["events"]))

    # -- calls ---------------------------------------------------------------------------------------
    def _pick(self, active: OpenRollout) -> list[str]:
        """Upstreams to try, in order: the rollout's own first, then the least busy of those up."""
        now = time.monotonic()
        up = [u for u in self.upstreams if self._down_until[u] <= now]
        ranked = sorted(up, key=lambda u: self._in_flight[u])
        if active.upstream in up:
            ranked.remove(active.upstream)
            ranked.insert(0, active.upstream)
        return ranked or list(self.upstreams)  # all marked down: try them anyway

    @contextlib.contextmanager
    def _in_rollout(self, active: OpenRollout, agent: str | None) -> Iterator[None]:
        with rollout_scope(active.state, agent), current_span_of_ours(active.span):
            yield

    def _tool_spans(self, active: OpenRollout, body: dict[str, Any]) -> None:
        """A tool message answering one of the assistant's tool calls: a tool span, once per call id."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return
        asked: dict[str, dict[str, Any]] = {}
        for message in messages:
            if not isinstance(message, dict):
                continue
            for tc in message.get("tool_calls") or ():
                if isinstance(tc, dict) and isinstance(tc.get("id"), str) and isinstance(tc.get("function"), dict):
                    asked[tc["id"]] = tc["function"]
            call_id = message.get("tool_call_id")
            if message.get("role") == "tool" and isinstance(call_id, str) and call_id \
                    and call_id not in active.tool_calls_seen:
                active.tool_calls_seen.add(call_id)
                fn = asked.get(call_id, {})
                with record_tool_span(fn.get("name") or message.get("name") or "tool", call_id,
                                      fn.get("arguments"), SimpleNamespace(result=message.get("content"))):
                    pass

    def start_call(self, active: OpenRollout, op: str, body: dict[str, Any], agent: str | None,
                   upstream: str) -> LLMCall:
        with self._in_rollout(active, agent):
            if op == semconv.OP_CHAT:
                self._tool_spans(active, body)
            return LLMCall(self._clients[upstream], _Options(body), op, active.state, json=True)

    async def forward(self, active: OpenRollout, path: str, body: dict[str, Any], agent: str | None,
                      render: Any = None) -> Any:
        """Send one call to an engine and record it; returns (status, JSON) or a ``Relay`` of SSE bytes
        (the engine's chunks as ``render`` writes them: by default as the engine sent them)."""
        op = _ENDPOINTS[path]
        errors: list[str] = []
        for upstream in self._pick(active):
            call = self.start_call(active, op, body, agent, upstream)
            try:
                result = await self._send(call, upstream, path, body, render or ChatRenderer())
            except UpstreamError as exc:
                self._down_until[upstream] = time.monotonic() + self.down_for
                errors.append(f"{upstream}: {exc}")
                call.finish(error=ConnectionError(f"{upstream} could not be reached: {exc}"))
                count("gateway_upstream_unreachable")
                continue
            active.upstream = upstream
            return result
        raise GatewayError(502, "no upstream engine could serve this call (tried them all); it is recorded on the "
                                "rollout as a failed call", errors)

    def _pool(self, upstream: str) -> Upstream:
        pool = self._pools.get(upstream)
        if pool is None:
            pool = self._pools[upstream] = Upstream(upstream, timeout=self.timeout)
        return pool

    async def _send(self, call: LLMCall, upstream: str, path: str, body: dict[str, Any], render: Any) -> Any:
        stream = bool(body.get("stream"))
        pool = self._pool(upstream)
        while True:
            sent = orjson.dumps({**body, **(call.options.extra_json or {})})
            self._in_flight[upstream] += 1
            try:
                response = await pool.post(f"/v1/{path}", sent, stream=stream)
                if response.status_code != 200 or not stream:
                    raw = await response.read()
            except BaseException:
                self._in_flight[upstream] -= 1
                raise
            if response.status_code != 200:
                self._in_flight[upstream] -= 1
                text = raw.decode(errors="replace")
                refused = _UpstreamStatus(response.status_code, text)
                if _resend_without_token_fields(call, refused):
                    _refused_token_fields(call)
                    continue
                call.finish(error=refused)
                return response.status_code, _error_json(text)
            if not stream:
                self._in_flight[upstream] -= 1
                data = orjson.loads(raw)
                call.record_response(data)
                return 200, _strip(data, call.injected)
            call.streamed = True
            return Relay(self._relay(call, response, upstream, render), response)

    async def _relay(self, call: LLMCall, response: UpstreamResponse, upstream: str, render: Any) -> AsyncIterator[bytes]:
        """The engine's SSE lines, read as they arrive and recorded; what one network read brings is
        written to the client in one piece (one send per read, not per line)."""
        finished = False
        pending = b""
        try:
            async for received in response.iter_bytes():
                *lines, pending = (pending + received).split(b"\n")
                out = []
                for raw in lines:
                    line = raw.rstrip(b"\r")
                    payload = line[5:].strip() if line.startswith(b"data:") else None
                    if payload == b"[DONE]":
                        finished = True
                        out.append(render.done())
                        continue
                    data = None
                    if payload:
                        try:
                            data = orjson.loads(payload)
                        except orjson.JSONDecodeError:
                            pass
                    if data is not None:
                        call.on_chunk(data)
                        out.append(render.chunk(data, call.injected))
                    elif line and render.passthrough:  # comments, events, anything else the engine sent
                        out.append(line + b"\n\n")
                if out:
                    yield b"".join(out)
        finally:
            response.close()
            self._in_flight[upstream] -= 1
            call.finish(incomplete=not finished)

    async def close(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()


class Relay:
    """A streamed answer: the SSE bytes to send (``async for``), and ``abort`` for a client that hung up
    (closes the engine's connection, so the engine stops and the call is recorded as cut)."""

    def __init__(self, chunks: AsyncIterator[bytes], response: UpstreamResponse) -> None:
        self.chunks, self._response = chunks, response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks

    def abort(self) -> None:
        self._response.abort()

    async def aclose(self) -> None:
        await self.chunks.aclose()


def _error_json(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return {"error": {"message": text[:2000]}}


def create_app(gateway: Gateway) -> Any:
    """The ASGI app serving ``gateway``."""

    async def sweep() -> None:
        every = min(60.0, gateway.idle_timeout / 4)
        while True:
            try:  # first at start: what a gateway killed before this one left running
                await asyncio.to_thread(gateway.expire_orphans)
            except Exception as exc:
                report_failure("gateway orphan sweep", exc)
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(gateway.expire_idle)
            except Exception as exc:
                report_failure("gateway idle sweep", exc)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        sweeper = asyncio.ensure_future(sweep()) if gateway.idle_timeout is not None else None
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            try:  # on this thread: at interpreter exit (a local gateway) no worker thread can be started
                gateway.end_all("the gateway stopped before the rollout was finished (its key died with it); the "
                                "calls so far are recorded")
            except Exception as exc:  # the store may be gone already; the records so far stay as they are
                report_failure("gateway stop", exc)
            await gateway.close()

    app = FastAPI(title="lightning-rl gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    def _json(data: Any, status: int = 200) -> Response:
        return Response(orjson.dumps(data), status_code=status, media_type="application/json")

    async def _raw(request: Request) -> bytes:
        """The body, read up to the limit (413 beyond it, also when it comes chunked)."""
        limit = gateway.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
        parts, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
            parts.append(piece)
        return b"".join(parts)

    async def _body(request: Request) -> dict[str, Any]:
        return _parse_body(await _raw(request), gateway.max_body_bytes, invalid=422)

    @app.exception_handler(GatewayError)
    async def _refused(request: Request, exc: GatewayError) -> Response:
        # OpenAI's error shape, so that an agent's OpenAI client shows the reason
        return _json(_openai_error(exc.status, exc.error, exc.details), exc.status)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        gateway.check_admin(request.headers)  # like every route but health
        return _json(app.openapi())

    @app.get("/v1/health")
    async def health() -> Response:
        now = time.monotonic()
        return _json({"ok": True, "open_rollouts": len(gateway.rollouts),
                      "upstreams": {u: {"up": gateway._down_until[u] <= now, "in_flight": gateway._in_flight[u]}
                                    for u in gateway.upstreams}})

    @app.post("/v1/rollouts")
    async def open_rollout(request: Request) -> Response:
        gateway.check_admin(request.headers)
        body = await _body(request)
        return _json(await asyncio.to_thread(gateway.open_rollout, body, str(request.base_url)))

    def _credentials(request: Request, rollout_id: str) -> None:
        """A rollout's key or the gateway's token, before its body is read (401 or 403 either way,
        whether or not the rollout exists; the route itself then tells 404 from 409)."""
        given = gateway._bearer(request.headers)
        owner = gateway._by_key.get(given) if given and given.startswith(_KEY_PREFIX) else None
        if owner is None and not gateway._is_admin(given):
            raise GatewayError(401, "send the rollout's api_key (or the gateway's token) as the bearer token")
        if owner is not None and owner != rollout_id:
            raise GatewayError(403, "this key belongs to another rollout; a rollout key writes only its own rollout")

    @app.post("/v1/rollouts/{rollout_id}/rewards")
    async def reward(rollout_id: str, request: Request) -> Response:
        _credentials(request, rollout_id)
        body = await _body(request)
        return _json(await asyncio.to_thread(gateway.reward, rollout_id, body, request.headers))

    @app.post("/v1/rollouts/{rollout_id}/finish")
    async def finish(rollout_id: str, request: Request) -> Response:
        _credentials(request, rollout_id)
        body = await _body(request)
        return _json(await asyncio.to_thread(gateway.finish, rollout_id, body, request.headers))

    async def _traces(request: Request, rollout_id: str | None) -> Response:
        gateway.check_spans_sender(rollout_id, request.headers)  # before a byte of the body is read or inflated
        body = await _raw(request)
        kind = otlp.content_kind(request.headers.get("content-type"))
        try:
            spans = otlp.decode(body, kind, request.headers.get("content-encoding"), gateway.max_body_bytes)
        except otlp.OTLPTooLarge as exc:
            raise GatewayError(413, str(exc)) from None
        except otlp.OTLPDecodeError as exc:
            raise GatewayError(400, str(exc)) from None
        problems = otlp.span_problems(spans)
        if problems:
            raise GatewayError(400, f"{len(problems)} span value(s) cannot be stored; nothing of this export was "
                                    f"stored: {problems[0]}", problems)
        taken = await asyncio.to_thread(gateway.take_spans, spans, rollout_id, request.headers)
        return Response(otlp.encode_answer(taken["rejected"], taken["message"], kind),
                        media_type="application/x-protobuf" if kind == "protobuf" else "application/json")

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        return await _traces(request, None)

    @app.post("/rollouts/{rollout_id}/v1/traces")
    async def rollout_traces(rollout_id: str, request: Request) -> Response:
        return await _traces(request, rollout_id)

    return _CallFront(gateway, app)


def _openai_error(status: int, message: str, details: list[str] | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "lightning_rl_gateway", "code": status, "details": details or []}}


def _parse_body(raw: bytes, limit: int, invalid: int = 400) -> dict[str, Any]:
    """A JSON object body; ``invalid``: the status for a value that cannot be recorded (the LLM routes
    answer 400 as OpenAI's API does; the gateway's own routes 422)."""
    if len(raw) > limit:
        raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, "the request body is not valid JSON", [str(exc)]) from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    problem = json_problem(body, "body")
    if problem:
        raise GatewayError(invalid, f"the request body cannot be recorded: {problem}")
    return body


def _check_messages(messages: Any) -> None:
    """Chat messages the assembly can read back, or 400 before anything is forwarded or recorded."""
    problems = message_problems(messages)
    if problems:
        raise GatewayError(400, f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                           problems)


# A call's path: under /v1 (rollout by key), a rollout's base URL, or an agent's.
_CALL_PATH = re.compile(r"(?:/rollouts/(?P<rollout>[^/]+)(?:/agents/(?P<agent>[^/]+))?)?"
                        r"/v1/(?P<endpoint>chat/completions|completions|messages|responses)")
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class _CallFront:
    """The gateway's ASGI app: the LLM calls (the hot path, every call an agent makes) answered here
    directly, everything else by the FastAPI app behind. Routing a call through FastAPI's middleware,
    request objects and streaming response cost a sixth of the gateway's CPU per call
    (docs/benchmarks.md section 12); these routes need none of it."""

    def __init__(self, gateway: Gateway, app: Any) -> None:
        self.gateway, self.app = gateway, app
        # The dialects answered through chat completions: (to chat, stream renderer, from chat, error shape).
        self.dialects = {
            "messages": (anthropic.to_chat, lambda body: anthropic.StreamRenderer(body["model"]),
                         lambda data, body: anthropic.from_chat(data, body["model"]), anthropic.error),
            "responses": (responses.to_chat, responses.StreamRenderer, responses.from_chat, _openai_error),
        }

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _CALL_PATH.fullmatch(scope["path"])
            if match is not None:
                await self._call(scope, receive, send, *match.group("rollout", "agent", "endpoint"))
                return
        await self.app(scope, receive, send)

    async def _call(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any],
                    rollout_id: str | None, agent: str | None, endpoint: str) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        dialect = self.dialects.get(endpoint)
        try:
            active = self.gateway.rollout_for(rollout_id, headers)  # credentials before the body is read
            raw = await self._read(receive, headers)
            if dialect is None:
                result = await self._chat(headers, raw, active, agent, endpoint)
            else:
                result = await self._translated(headers, raw, active, agent, dialect)
        except GatewayError as exc:
            shape = dialect[3](exc.status, exc.error) if dialect else _openai_error(exc.status, exc.error, exc.details)
            result = exc.status, shape
        except Exception as exc:  # a defect of ours: the agent gets a 500 that says so, the failure is logged
            report_failure("gateway call", exc)
            result = 500, _openai_error(500, f"the gateway failed on this call: {type(exc).__name__}: {exc}")
        if isinstance(result, Relay):
            await self._stream(result, receive, send)
            return
        status, data = result
        body = orjson.dumps(data)
        await send({"type": "http.response.start", "status": status,
                    "headers": [_JSON, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _read(self, receive: Callable[..., Any], headers: dict[str, str]) -> bytes:
        limit = self.gateway.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise GatewayError(400, "the client hung up before sending its whole request")
            piece = message.get("body", b"")
            size += len(piece)
            if size > limit:
                raise GatewayError(413, f"request body over the gateway's limit of {limit} bytes")
            parts.append(piece)
            if not message.get("more_body"):
                return b"".join(parts)

    async def _stream(self, relay: Relay, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        """Send a stream as it comes; a client that hangs up cuts the engine's answer (recorded as cut)."""
        hung_up = False

        async def listen() -> None:
            nonlocal hung_up
            while (await receive())["type"] != "http.disconnect":
                pass
            hung_up = True
            relay.abort()

        listener = asyncio.ensure_future(listen())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
            async for piece in relay:
                if hung_up:
                    break
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except UpstreamError:
            if not hung_up:  # the engine broke off: the client's stream breaks off too
                raise
        finally:
            listener.cancel()
            await relay.aclose()

    async def _chat(self, headers: dict[str, str], raw: bytes, active: OpenRollout, agent: str | None,
                    path: str) -> Any:
        body = _parse_body(raw, self.gateway.max_body_bytes)
        if not isinstance(body.get("model"), str):
            raise GatewayError(422, f"model must be the served model's name (a string), got {body.get('model')!r}")
        if path == "chat/completions":
            _check_messages(body.get("messages"))
        return await self.gateway.forward(active, path, body, agent or headers.get(AGENT_HEADER))

    async def _translated(self, headers: dict[str, str], raw: bytes, active: OpenRollout, agent: str | None,
                          dialect: tuple[Any, ...]) -> Any:
        """Anthropic Messages or OpenAI Responses, through chat completions; errors in the dialect's shape."""
        to_chat, renderer, from_chat, error = dialect
        body = _parse_body(raw, self.gateway.max_body_bytes)
        if not isinstance(body.get("model"), str):
            raise GatewayError(400, f"model must be the served model's name (a string), got {body.get('model')!r}")
        try:
            chat = to_chat(body)
        except anthropic.TranslationError as exc:
            raise GatewayError(400, str(exc)) from None
        _check_messages(chat.get("messages"))
        chat["model"] = body["model"]
        stream = bool(chat.get("stream"))
        if stream:
            chat["stream_options"] = {"include_usage": True}  # the usage the final events carry
        result = await self.gateway.forward(active, "chat/completions", chat, agent or headers.get(AGENT_HEADER),
                                            render=renderer(body) if stream else None)
        if isinstance(result, Relay):
            return result
        status, data = result
        if status != 200:
            detail = data.get("error", data) if isinstance(data, dict) else data
            message = detail.get("message") if isinstance(detail, dict) else str(detail)
            return status, error(status, f"the engine answered {status}: {message}")
        return 200, from_chat(data, body)


class CommandFailed(LightningRLError, RuntimeError):
    """A command agent exited with a non-zero status (its rollout is recorded as failed)."""


_LOCAL: dict[tuple[str, ...], BackgroundGateway] = {}
_LOCAL_LOCK = threading.Lock()


def local_gateway(upstreams: list[str]) -> BackgroundGateway:
    """This process's gateway in front of ``upstreams`` (started once, on a thread, on loopback)."""
    key = tuple(upstreams)
    with _LOCAL_LOCK:
        gw = _LOCAL.get(key)
        if gw is None:
            gw = _LOCAL[key] = BackgroundGateway(list(upstreams)).__enter__()
            atexit.register(gw.__exit__, None, None, None)
        return gw


def _reward_of(stdout: bytes) -> float | None:
    """The number on the last non-empty line of a command's output, if it is one."""
    lines = [x.strip() for x in stdout.decode(errors="replace").splitlines() if x.strip()]
    if not lines:
        return None
    try:
        value = float(lines[-1])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def command(argv: Sequence[str], *, upstream: str | Sequence[str], name: str | None = None,
            agent: str | None = None, env: Mapping[str, str] | None = None, timeout: float | None = None,
            mode: str | None = None) -> Callable[[Any], Any]:
    """An agent that is a command: a traced async function ``agent(task)`` that runs ``argv`` once per
    rollout, for ``Trainer`` or any caller, in any language.

    The process gets the rollout's ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (an in-process gateway in
    front of ``upstream``, so every OpenAI-client call it makes is recorded with the engine's token
    ids), the task as JSON on stdin and in ``LIGHTNING_RL_TASK``, and ``LIGHTNING_RL_REWARDS_URL``
    (POST ``{"value": ..., "name": ...}``). A number on the last line of its output is the rollout's
    reward. A non-zero exit fails the rollout with the end of its stderr (``CommandFailed``); a
    ``timeout`` kills it."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ConfigurationError(f"command needs the program and its arguments as a list of strings, e.g. "
                                 f"['node', 'agent.mjs'], got {argv!r}")
    upstreams = [upstream] if isinstance(upstream, str) else list(upstream)
    Gateway(upstreams)  # bad URLs are refused here, before any rollout
    argv = list(argv)
    extra = dict(env or {})

    @trace(name=name or os.path.basename(argv[-1]), agent=agent, mode=mode)
    async def run(task: Any) -> float | None:
        gw = local_gateway(upstreams)
        state = current_rollout()
        opened = gw.gateway.adopt(state, current_our_span(), gw.url)
        task_json = orjson.dumps(task).decode()
        child_env = {**os.environ, **extra, "OPENAI_BASE_URL": opened["base_url"], "OPENAI_API_KEY": opened["api_key"],
                     "LIGHTNING_RL_ROLLOUT_ID": state.rollout_id, "LIGHTNING_RL_TASK": task_json,
                     "LIGHTNING_RL_REWARDS_URL": f"{gw.url}/v1/rollouts/{state.rollout_id}/rewards",
                     # an agent instrumented with an OpenTelemetry SDK sends its spans to its rollout
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": opened["base_url"] + "/traces",
                     "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"authorization=Bearer%20{opened['api_key']}"}
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, env=child_env,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                out, err = await asyncio.wait_for(proc.communicate(task_json.encode() + b"\n"), timeout)
            except BaseException:  # timed out or cancelled: the process goes too
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise
        finally:
            gw.gateway.release(state.rollout_id)
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-2000:]
            raise CommandFailed(f"{' '.join(argv)} exited with status {proc.returncode}: {tail or '(no stderr)'}")
        return _reward_of(out)

    return run


def check_bind(host: str, token: str | None) -> None:
    from ..store.serving import is_loopback

    if not token and not is_loopback(host):
        raise ConfigurationError(f"binding the gateway to {host!r} exposes it beyond this machine; give it a "
                                 "token (--token or LIGHTNING_RL_GATEWAY_TOKEN), or bind to 127.0.0.1")


class BackgroundGateway:
    """The gateway on a thread of this process (tests, notebooks). Port 0 picks a free port."""

    def __init__(self, upstreams: list[str], *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 **options: Any) -> None:
        from ..store.serving import ServerThread

        check_bind(host, token)
        self.gateway = Gateway(upstreams, token=token, **options)
        self._thread = ServerThread(create_app(self.gateway), host=host, port=port, name="lightning-rl-gateway")
        self.port, self.url = self._thread.port, self._thread.url

    def __enter__(self) -> BackgroundGateway:
        self._thread.start("the gateway")
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.stop()


def serve(gateway: Gateway, *, host: str = "127.0.0.1", port: int = 8400, log_level: str = "warning") -> None:
    """Run the gateway until interrupted (one process: its open rollouts live in memory)."""
    import uvicorn

    from ..store.serving import uvicorn_options

    check_bind(host, gateway.token)
    uvicorn.run(create_app(gateway), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
                **uvicorn_options())


__all__ = ["BackgroundGateway", "CommandFailed", "Gateway", "GatewayError", "command", "create_app", "serve"]
