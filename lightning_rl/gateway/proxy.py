"""The gateway: trace agents in any language or process (``lightning-rl gateway``).

An HTTP server (uvicorn; FastAPI for its admin routes; a lean keep-alive client to the engines, ``upstream.py``) in front of one or more OpenAI-compatible
engines (vLLM). An agent that cannot import lightning_rl (a Node or Go service, a CLI, a container)
opens a rollout over HTTP and points its OpenAI client at the rollout: every call it makes is
forwarded to an engine and recorded as ``@trace`` records a Python agent's calls, through the same
code (the capture core, ``capture/exchange.py``): the same spans with the engine's token ids and log-probs, the
same rollouts and rewards, in whatever store the tracer writes to (a SQLite file or the store server).

Routes (JSON bodies; errors in OpenAI's shape, ``{"error": {"message": ..., "code": status, "details": [...]}}``):

* ``POST /v1/rollouts`` ``{task, group_id?, attempt?, mode?, agent?, name?, model?}`` opens a rollout and
  answers ``{rollout_id, base_url, api_key}``; ``model``: every call of the rollout goes to the engine as
  this served model, whatever name the agent asks for (a CLI asking for its vendor's names; the name
  asked is kept on the call, ``lightning_rl.request.model_asked``). ``base_url`` (``.../rollouts/{id}/v1``) and ``api_key``
  each route a client's calls to the rollout alone, so an unmodified client that lets you set only
  one of them works.
* ``POST .../v1/chat/completions`` and ``POST .../v1/completions``, streamed (SSE) or not, under the
  rollout's base URL, or under ``/v1`` with the rollout's key as the bearer token. The gateway asks
  the engine for token ids and log-probs itself (``return_token_ids``, ``logprobs``) and takes out
  of the answer what the client did not ask for; the rest is what the engine sent. An agent name per
  call: ``.../rollouts/{id}/agents/{agent}/v1/...`` or the ``X-Lightning-RL-Agent`` header.
* ``POST .../v1/messages``: Anthropic Messages, sent to the engine as chat completions and answered
  in the Messages format, streamed or not (``capture/dialects/anthropic.py``); the key also as ``x-api-key``.
  Claude Code's sub-agent and compaction calls are named as such (``coding_agents.claude_code_lineage``). A
  request the dialect cannot carry is answered 400 in the dialect's error shape and kept on the rollout (a
  ``request refused`` event of its root span); a path with ``/v1`` twice (a client given a base URL with
  ``/v1`` that adds its own) is answered 404 naming the fix.
* ``POST .../v1/responses``: the OpenAI Responses API, the same way (``capture/dialects/responses.py``).
* ``POST /v1/traces`` (and under a rollout's path): OTLP/HTTP spans from the agent's own
  OpenTelemetry SDK, added to the rollout they name (``otlp.py``).
* Tool spans come from the conversation itself: a ``tool`` message answering one of the assistant's
  tool calls becomes a tool span (name, call id, arguments, result) the first time a request carries
  it.
* ``POST /v1/rollouts/{id}/rewards`` ``{value, name?}``: a reward, mid-run (on the rollout's latest
  finished call, as ``emit_reward``) or after the end (late feedback).
* ``POST /v1/rollouts/{id}/finish`` ``{status, reward?, error?}``: the end (``succeeded``/``failed``).
* ``GET /v1/health``; ``GET /v1/upstreams`` (with the token): the engines it routes to.

Engines: a rollout's calls stick to one upstream (its prefix cache); a new rollout goes to the
upstream with the fewest calls in flight among those not marked down. An upstream that cannot be
reached is marked down for ``down_for`` seconds and the call goes to the next; a call no upstream can
serve gets 502 and is recorded on the rollout as a failed call. Policy versions are stamped as the
tracer stamps them: from the publishes recorded in the store.

Several gateways behind a plain balancer (``shared=True``, ``--shared``, the same token on each): a
rollout's state lives in the store and any of them serves its next request (``shared.py``).

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

from typing import Any

from ..capture import Server
from ..errors import ConfigurationError
from ..tracer.provider import tracing
from .auth import Auth
from .forwarding import Forwarding
from .rollouts import OpenRollout, Rollouts
from .shared import ClockSeq, Shared, check_shared
from .upstream import Upstream

DEFAULT_MAX_BODY = 16 * 2**20


class Gateway(Auth, Rollouts, Forwarding, Shared):
    """The gateway's state: open rollouts, upstreams; who may do what (``auth.py``), the rollouts' lifecycle
    (``rollouts.py``) and the calls (``forwarding.py``). The app serving it is ``app.py``. ``shared``:
    rollouts live in the store, so that gateways behind a plain balancer serve each other's (``shared.py``;
    needs ``token``, the same on each). ``model``: every call goes to the engine as this served model,
    whatever name the agent asked for (a CLI asking for its vendor's names), unless its rollout was opened
    with a model of its own."""

    def __init__(self, upstreams: list[str], *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
                 down_for: float = 10.0, timeout: float = 600.0, idle_timeout: float | None = 3600.0,
                 shared: bool = False, model: str | None = None) -> None:
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
        check_shared(shared, token)
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise ConfigurationError(f"--model must be the served model's name, got {model!r}")
        tracing.redaction(check=True)  # a LIGHTNING_RL_REDACT naming no function stops the gateway as it starts
        self.upstreams = cleaned
        self.token = token
        self.shared = shared
        self.model = model  # every call sent as this model, unless its rollout names its own (rollouts.py)
        self._seq = ClockSeq()
        self.idle_timeout = idle_timeout
        self.max_body_bytes = max_body_bytes
        self.down_for = down_for
        self.timeout = timeout
        self.rollouts: dict[str, OpenRollout] = {}
        self._by_key: dict[str, str] = {}
        self._in_flight = dict.fromkeys(cleaned, 0)
        self._down_until = dict.fromkeys(cleaned, 0.0)
        self._pools: dict[str, Upstream] = {}
        self._servers = {u: Server.from_url(u) for u in cleaned}

    @property
    def store(self) -> Any:
        return tracing.sink()

    def upstream_urls(self) -> list[str]:
        """The engines this gateway sends calls to, as given (without ``/v1``): the replicas a publish
        must reach (also ``GET /v1/upstreams``, with the gateway's token)."""
        return list(self.upstreams)
