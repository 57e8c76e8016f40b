"""Where agents meet the sandbox: ``lrl.sandbox()`` inside a rollout is the try's own sandbox, taken from the pool
its runner (or ``lrl.sandboxes(pool)``) gave the try, on first use; each command run there is a tool span.

A sandbox that cannot be had (the pool's starts failed ``infra_retries + 1`` times, it died) raises ``SandboxError``
into the agent: its rollout fails as an infrastructure failure and its group leaves the batch. A command that fails
inside the sandbox is the model's: its exit code, an observation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import orjson

from ..diagnostics import count
from ..errors import ConfigurationError, SandboxError
from .base import RunResult

#: What a tool span keeps of each of a command's stdout and stderr (the rest is counted, not kept).
SPAN_OUTPUT_CHARS = 4000

_holder: ContextVar["Tries | None"] = ContextVar("lightning_rl_sandboxes", default=None)


class Tries:
    """The sandboxes a block's tries took from ``pool``, by rollout id; given back when the block ends."""

    def __init__(self, pool: Any, infra_retries: int) -> None:
        self.pool, self.infra_retries = pool, infra_retries
        self.leases: dict[str, tuple[Any, Any]] = {}  # rollout id -> (context manager, sandbox)

    def take(self, rollout_id: str) -> Any:
        held = self.leases.get(rollout_id)
        if held is not None:
            if not held[1].alive():
                raise SandboxError("the try's sandbox died (closed, or its pool took it back at its lifetime); "
                                   "the try fails as infrastructure")
            return held[1]
        for attempt in range(self.infra_retries + 1):
            lease = self.pool.acquire()
            try:
                box = lease.__enter__()
                break
            except SandboxError:
                if attempt == self.infra_retries:
                    raise
                count("sandbox_infra_retries")
        self.leases[rollout_id] = (lease, box)
        return box

    def give_back(self) -> None:
        leases, self.leases = self.leases, {}
        for lease, _ in leases.values():
            lease.__exit__(None, None, None)


@contextlib.contextmanager
def sandboxes(pool: Any, *, infra_retries: int = 2) -> Iterator[None]:
    """Tries run in this block take their sandbox (``lrl.sandbox()``) from ``pool`` (a ``SandboxPool``), and give
    it back, reset, when the block ends. A start that fails is retried ``infra_retries`` times (counted)."""
    if not isinstance(infra_retries, int) or isinstance(infra_retries, bool) or infra_retries < 0:
        raise ConfigurationError(f"infra_retries={infra_retries!r}: give a whole number >= 0")
    tries = Tries(pool, infra_retries)
    try:
        with tries_of(tries):
            yield
    finally:
        tries.give_back()


@contextlib.contextmanager
def tries_of(tries: "Tries | None") -> Iterator[None]:
    """The block's tries take their sandboxes from ``tries`` (a runner's, one per try); nothing when None."""
    if tries is None:
        yield
        return
    token = _holder.set(tries)
    try:
        yield
    finally:
        _holder.reset(token)


def current_sandbox(*, required: bool = True) -> Any:
    """The try's sandbox (raw, untraced), taken on first use; None when no pool is set and not ``required``."""
    from ..tracer import current_rollout

    state = current_rollout()
    tries = _holder.get()
    if state is None or tries is None:
        if not required:
            return None
        if state is None:
            raise ConfigurationError("lrl.sandbox() is the try's sandbox: call it inside a traced agent (@lrl.trace)")
        raise ConfigurationError("this try has no sandbox pool: give Runner(sandboxes=SandboxPool(snapshot)) or "
                                 "run the agent inside `with lrl.sandboxes(pool):`")
    return tries.take(state.rollout_id)


class TracedSandbox:
    """A try's sandbox whose commands are tool spans (``execute_tool sandbox``): the argv as the arguments; the exit
    code, why it ended, duration and output (each stream cut at ``SPAN_OUTPUT_CHARS``) as the result."""

    def __init__(self, box: Any) -> None:
        self.box = box

    def __getattr__(self, name: str) -> Any:  # put, get, restore, folder, workdir, ...
        return getattr(self.box, name)

    def run(self, argv: Sequence[str], *, stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0) -> RunResult:
        from ..tracer.provider import record_tool_span

        holder = type("Result", (), {"result": None})()
        with record_tool_span("sandbox", None, orjson.dumps(list(argv)).decode(), holder):
            began = time.monotonic()
            done = self.box.run(argv, stdin=stdin, env=env, cwd=cwd, timeout=timeout)
            count("sandbox_commands")
            if not done.ok:  # the model's: an observation for the agent (counted, never an infrastructure failure)
                count("sandbox_commands_failed")
            holder.result = {"exit_code": done.exit_code, "ended": done.ended, "signal": done.signal,
                             "duration_s": round(time.monotonic() - began, 4),
                             "stdout": done.stdout[-SPAN_OUTPUT_CHARS:], "stderr": done.stderr[-SPAN_OUTPUT_CHARS:],
                             "output_cut_chars": max(len(done.stdout) - SPAN_OUTPUT_CHARS, 0)
                             + max(len(done.stderr) - SPAN_OUTPUT_CHARS, 0) + done.truncated_bytes}
        return done


def sandbox() -> TracedSandbox:
    """The try's own sandbox (inside a traced agent run by a runner with ``sandboxes=`` or in ``lrl.sandboxes``);
    its ``run`` records each command as a tool span."""
    return TracedSandbox(current_sandbox())
