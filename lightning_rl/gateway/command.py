"""``lrl.command``: a program in any language as a traced agent. Each call runs it with a rollout of its
own on a gateway of this process (one per set of upstreams), its task on stdin and the rollout's base
URL and key in its environment; a reward it prints as its last line of JSON is recorded."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import math
import os
import shutil
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from ..diagnostics import count
from ..errors import CommandFailed, ConfigurationError, SandboxError
from ..settings import ENV_MODEL, ENV_REWARDS_URL, ENV_ROLLOUT_ID, ENV_TASK
from ..forks import exec_after_fork
from ..tracer.context import current_rollout
from ..tracer.decorator import current_endpoint, trace
from ..tracer.provider import current_our_span
from .app import BackgroundGateway
from .proxy import Gateway


_LOCAL: dict[tuple[str, ...], BackgroundGateway] = {}
_LOCAL_LOCK = threading.Lock()


def local_gateway(upstreams: list[str]) -> BackgroundGateway:
    """This process's gateway in front of ``upstreams`` (started once, on a thread, on loopback). It sweeps
    nothing (``idle_timeout=None``): its rollouts are the traced functions' own, ended by their ``@trace``;
    the store's orphaned gateway rollouts are the standalone gateways' (and ``rollouts expire``'s) to end,
    and reading them needs a reader's store token, which a runner process does not have."""
    key = tuple(upstreams)
    with _LOCAL_LOCK:
        gw = _LOCAL.get(key)
        if gw is None:
            gw = _LOCAL[key] = BackgroundGateway(list(upstreams), idle_timeout=None).__enter__()
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
            mode: str | None = None, reward: Callable[[Any, str], float | None] | None = None,
            model: str | None = None, stdin: Callable[[Any], str] | None = None,
            cwd: str | os.PathLike[str] | None = None, label: str | None = None,
            sandbox: str | None = None, sandbox_folder: Callable[[Any], Any] | None = None,
            read_only: Sequence[str] = ()) -> Callable[[Any], Any]:
    """An agent that is a command: a traced async function ``agent(task)`` that runs ``argv`` once per
    rollout, for ``Trainer`` or any caller, in any language.

    The process gets the rollout's ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (an in-process gateway in
    front of ``upstream``, so every OpenAI-client call it makes is recorded with the engine's token
    ids), the same as ``ANTHROPIC_BASE_URL`` (without ``/v1``, as Anthropic's clients want it) and
    ``ANTHROPIC_API_KEY`` (``ANTHROPIC_AUTH_TOKEN`` removed: no credential of yours reaches the gateway),
    the task as JSON on stdin (``stdin(task)``: other text) and in ``LIGHTNING_RL_TASK``, and
    ``LIGHTNING_RL_REWARDS_URL`` (POST ``{"value": ..., "name": ...}``). A number on the last line of its
    output is the rollout's reward. It runs in a process group of its own, in ``cwd``.

    Ends: a non-zero exit fails the rollout with the end of its stderr (else of its output) and raises
    ``CommandFailed``; past ``timeout`` seconds (or when the call is cancelled) its whole process group
    is killed and the rollout ends ``timed_out``, raising ``TimeoutError`` with the reason. Either way
    every call it made is kept, and when it exits its group's leftovers (a shell it left in the
    background) are killed too.

    ``model``: every LLM call the process makes goes to the engine as this model, whatever name it asked
    for (the name asked is kept on the call: ``lightning_rl.request.model_asked``); a CLI that asks for
    its vendor's names (Claude Code's ``claude-opus-*``) is served by the policy.

    ``upstream=None``: each rollout's engine is the endpoint its caller chose (``lrl.current_endpoint()``:
    a verl server, when a runner runs a try verl queued), and the process also gets that endpoint's model
    name in ``LIGHTNING_RL_MODEL`` (and, without ``model``, every call is sent as it); a rollout without an
    endpoint fails, naming the fix.

    ``reward``: the rollout's reward is ``reward(task, stdout)`` (the process's output, as text) instead of
    the number on its last line (the coding-agent CLIs, whose last line is the model's answer).
    ``label``: how its failures and timeouts name the process (default: its arguments).

    ``sandbox``: a sandbox backend (``"bwrap"``) to run the process in, reaching only the rollout's gateway (bridged
    in: ``lightning_rl.sandbox.bridge``), with a clean environment (the rollout's variables and ``env``, nothing of
    this process's) and the try's folder as its working folder: the try's own sandbox when its runner gave it one
    (``lrl.sandbox()``), else a fresh one with a copy of ``cwd``. Its program's folder is readable in there. A
    sandbox that fails to start raises ``SandboxError`` (an infrastructure failure). ``None``/``"none"``: on this
    host, as this user. ``sandbox_folder(task)``: the folder a fresh sandbox copies instead of ``cwd`` (a task's
    own); ``read_only``: more programs whose package folders it may read."""
    if isinstance(argv, str) or not argv or not argv[0] or not all(isinstance(a, str) for a in argv):
        raise ConfigurationError(f"command needs the program and its arguments as a list of strings, e.g. "
                                 f"['node', 'agent.mjs'], got {argv!r}")
    fixed = None if upstream is None else [upstream] if isinstance(upstream, str) else list(upstream)
    if fixed is not None:
        Gateway(fixed)  # bad URLs are refused here, before any rollout
    argv = list(argv)
    shown = label or " ".join(argv)
    extra = dict(env or {})
    if sandbox == "none":
        sandbox = None
    if sandbox is not None:
        from ..sandbox import SANDBOX_BACKENDS

        SANDBOX_BACKENDS.get(sandbox)  # an unknown name is refused here, naming the known ones

    @trace(name=name or os.path.basename(argv[-1]), agent=agent, mode=mode)
    async def run(task: Any) -> float | None:
        upstreams, served, endpoint_model = fixed, model, None
        if upstreams is None:
            endpoint = current_endpoint()
            if endpoint is None:
                raise ConfigurationError("lrl.command(upstream=None) runs against the endpoint its caller chose, and "
                                         "this rollout has none; give upstream='http://HOST:PORT' (the engine)")
            upstreams, endpoint_model = [endpoint[0].rstrip("/").removesuffix("/v1")], endpoint[1]
            served = served or endpoint_model
        gw = local_gateway(upstreams)
        state = current_rollout()
        opened = gw.gateway.adopt(state, current_our_span(), gw.url, model=served)
        task_json = orjson.dumps(task).decode()
        child_env = {**({} if sandbox else os.environ), **extra, "OPENAI_BASE_URL": opened["base_url"],
                     "OPENAI_API_KEY": opened["api_key"],
                     # Anthropic's clients add /v1 themselves
                     "ANTHROPIC_BASE_URL": opened["base_url"].removesuffix("/v1"),
                     "ANTHROPIC_API_KEY": opened["api_key"],
                     ENV_ROLLOUT_ID: state.rollout_id, ENV_TASK: task_json,
                     **({ENV_MODEL: endpoint_model or served} if endpoint_model or served else {}),
                     ENV_REWARDS_URL: f"{gw.url}/v1/rollouts/{state.rollout_id}/rewards",
                     # an agent instrumented with an OpenTelemetry SDK sends its spans to its rollout
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": opened["base_url"] + "/traces",
                     "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"authorization=Bearer%20{opened['api_key']}"}
        child_env.pop("ANTHROPIC_AUTH_TOKEN", None)  # it would be sent instead of the rollout's key
        if cwd is not None:  # as a shell sets it: a CLI that reads $PWD (opencode) must see its own folder
            child_env["PWD"] = os.path.abspath(cwd)
        given = (task_json if stdin is None else stdin(task)).encode() + b"\n"
        source = (sandbox_folder(task) if sandbox_folder is not None else None) or cwd
        jail = _Jail(sandbox, argv, source, gw.url, read_only) if sandbox else None
        try:
            if jail is None:
                proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, env=child_env,
                                                            cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                            stderr=asyncio.subprocess.PIPE,
                                                            start_new_session=True)  # its group: killed with it
            else:
                proc = await jail.start(child_env)
            try:
                out, err = await asyncio.wait_for(proc.communicate(given), timeout)
            except BaseException as exc:  # timed out or cancelled: the process and its group go too
                _kill_group(proc.pid)
                await proc.wait()
                if isinstance(exc, TimeoutError):
                    count("command_timeouts")
                    raise TimeoutError(f"{shown} ran past its timeout of {timeout:g} s; its process group "
                                       "was killed (the calls it made are kept)") from None
                raise
            _kill_group(proc.pid)  # what it left running in the background
            if jail is not None:
                jail.check_started(err)
        finally:
            gw.gateway.release(state.rollout_id)
            if jail is not None:
                await asyncio.to_thread(jail.close)
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-2000:] or out.decode(errors="replace").strip()[-2000:]
            raise CommandFailed(f"{shown} exited with status {proc.returncode}: {tail or '(no output)'}")
        return _reward_of(out) if reward is None else reward(task, out.decode(errors="replace"))

    return run


class _Jail:
    """A command's run in a sandbox (``command(sandbox=)``): the try's own or a fresh one, the gateway bridged in."""

    def __init__(self, backend: str, argv: list[str], cwd: Any, gateway_url: str, read_only: Sequence[str] = ()) -> None:
        from ..sandbox import current_sandbox, open_sandbox
        from ..sandbox.bridge import UnixBridge, host_port

        address = host_port(gateway_url)
        self.box = current_sandbox(required=False)
        self.own = self.box is None
        if self.own:
            self.box = open_sandbox(backend, cwd)
        try:
            if not hasattr(self.box, "launch"):
                raise ConfigurationError(f"the {type(self.box).__name__} sandbox cannot run a command behind the "
                                         "gateway bridge; use the bwrap backend")
            self.bridge = UnixBridge(*address)
        except BaseException:
            if self.own:
                self.box.close()
            raise
        self.argv = argv
        self.read_only = sorted({f for f in map(_install_folder, [argv[0], *read_only]) if f})
        self.status = self.cleanup = None

    async def start(self, env: dict[str, Any]) -> Any:
        from ..sandbox.bridge import INSIDE_FOLDER

        env = {**env, "HOME": "/tmp", "PWD": self.box.workdir}
        read, write = os.pipe()
        self.status = read
        try:
            full, prepare, self.cleanup = self.box.launch(self.bridge.wrap(self.argv), env, None, write,
                                                          binds={str(self.bridge.folder): INSIDE_FOLDER},
                                                          read_only=self.read_only)
            with exec_after_fork():  # the child only sets itself up and execs: no store is re-opened in it
                return await asyncio.create_subprocess_exec(
                    *full, stdin=asyncio.subprocess.PIPE, env={}, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, cwd=str(self.box.root), start_new_session=True,
                    preexec_fn=prepare, pass_fds=(write,))
        finally:
            os.close(write)

    def check_started(self, err: bytes) -> None:
        from ..sandbox.backends import read_status

        if b"child-pid" not in read_status(self.status):
            raise SandboxError(f"the {type(self.box).__name__} sandbox could not start the command: "
                               f"{err.decode(errors='replace').strip()[-500:] or '(no output)'}")

    def close(self) -> None:
        if self.status is not None:
            os.close(self.status)
        if self.cleanup is not None:
            self.cleanup()
        self.bridge.close()
        if self.own:
            self.box.close()


def _install_folder(program: str) -> str | None:
    """The folder a sandboxed program needs to read to run (its package: the top ``node_modules`` above it, else its
    own folder); None for one in the system's folders, which every sandbox reads."""
    found = shutil.which(program)
    if found is None:
        return None
    real = os.path.realpath(found)
    if real.startswith(("/usr/", "/bin/", "/sbin/", "/lib")):
        return None
    parts = real.split(os.sep)
    if "node_modules" in parts:
        return os.sep.join(parts[: parts.index("node_modules") + 1])
    return os.path.dirname(real)


def _kill_group(pgid: int) -> None:
    """Kill a command's process group (it leads one of its own: ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
