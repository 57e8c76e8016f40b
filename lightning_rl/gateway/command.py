"""``lrl.command``: a program in any language as a traced agent. Each call runs it with a rollout of its
own on a gateway of this process (one per set of upstreams), its task on stdin and the rollout's base
URL and key in its environment; a reward it prints as its last line of JSON is recorded."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from ..errors import CommandFailed, ConfigurationError
from ..settings import ENV_MODEL, ENV_REWARDS_URL, ENV_ROLLOUT_ID, ENV_TASK
from ..tracer.context import current_rollout
from ..tracer.decorator import current_endpoint, trace
from ..tracer.provider import current_our_span
from .app import BackgroundGateway
from .proxy import Gateway


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


def command(argv: Sequence[str], *, upstream: str | Sequence[str] | None = None, name: str | None = None,
            agent: str | None = None, env: Mapping[str, str] | None = None, timeout: float | None = None,
            mode: str | None = None) -> Callable[[Any], Any]:
    """An agent that is a command: a traced async function ``agent(task)`` that runs ``argv`` once per
    rollout, for ``Trainer`` or any caller, in any language.

    The process gets the rollout's ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (an in-process gateway in
    front of ``upstream``, so every OpenAI-client call it makes is recorded with the engine's token
    ids), the task as JSON on stdin and in ``LIGHTNING_RL_TASK``, and ``LIGHTNING_RL_REWARDS_URL``
    (POST ``{"value": ..., "name": ...}``). A number on the last line of its output is the rollout's
    reward. A non-zero exit fails the rollout with the end of its stderr (``CommandFailed``); a
    ``timeout`` kills it.

    ``upstream=None``: each rollout's engine is the endpoint its caller chose (``lrl.current_endpoint()``:
    a verl server, when a runner runs a try verl queued), and the process also gets that endpoint's model
    name in ``LIGHTNING_RL_MODEL``; a rollout without an endpoint fails, naming the fix."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ConfigurationError(f"command needs the program and its arguments as a list of strings, e.g. "
                                 f"['node', 'agent.mjs'], got {argv!r}")
    fixed = None if upstream is None else [upstream] if isinstance(upstream, str) else list(upstream)
    if fixed is not None:
        Gateway(fixed)  # bad URLs are refused here, before any rollout
    argv = list(argv)
    extra = dict(env or {})

    @trace(name=name or os.path.basename(argv[-1]), agent=agent, mode=mode)
    async def run(task: Any) -> float | None:
        upstreams, model = fixed, None
        if upstreams is None:
            endpoint = current_endpoint()
            if endpoint is None:
                raise ConfigurationError("lrl.command(upstream=None) runs against the endpoint its caller chose, and "
                                         "this rollout has none; give upstream='http://HOST:PORT' (the engine)")
            upstreams, model = [endpoint[0].rstrip("/").removesuffix("/v1")], endpoint[1]
        gw = local_gateway(upstreams)
        state = current_rollout()
        opened = gw.gateway.adopt(state, current_our_span(), gw.url)
        task_json = orjson.dumps(task).decode()
        child_env = {**os.environ, **extra, "OPENAI_BASE_URL": opened["base_url"], "OPENAI_API_KEY": opened["api_key"],
                     ENV_ROLLOUT_ID: state.rollout_id, ENV_TASK: task_json, **({ENV_MODEL: model} if model else {}),
                     ENV_REWARDS_URL: f"{gw.url}/v1/rollouts/{state.rollout_id}/rewards",
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
