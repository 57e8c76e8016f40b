"""What every sandbox backend offers (``Sandbox``), what a command's run returns (``RunResult``), the limits a run is
held to (``Limits``), and the process runner the backends share (``run_process``): a deadline that kills the whole
process group, output kept up to a cap and the rest counted, resource limits set in the child before it starts."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..forks import exec_after_fork
from typing import Protocol, runtime_checkable

from ..diagnostics import count
from ..errors import ConfigurationError, SandboxError

#: Why a run ended: the command exited, a signal ended it, the deadline did (the whole tree was killed), or it
#: exited with the try's writes over ``Limits.disk_mb`` (its exit code kept).
ENDINGS = ("exit", "signal", "deadline", "disk")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one command may use (``None``: no limit). Set as resource limits of the command's processes (inherited
    by what they start): address space (``memory_mb``), CPU seconds, the largest file written, open files; where
    control groups can be made (root; ``sandbox doctor`` says), processes, memory and ``cpus`` (a CPU share in cores)
    are held by the kernel for the whole tree of a bwrap try instead (a fork storm stops at ``processes``; a try past
    ``memory_mb`` is killed by the kernel's OOM killer, and no address-space limit is set); ``disk_mb``: the size of a bwrap try's private ``/tmp``
    and what its writes to its folder may add up to (checked after each command: ``RunResult.ended`` "disk");
    ``output_bytes``: what is kept of each of stdout and stderr (the rest is counted in
    ``RunResult.truncated_bytes``)."""

    memory_mb: int | None = 2048
    cpu_seconds: int | None = None
    file_mb: int | None = 512
    open_files: int | None = 1024
    processes: int | None = 256
    disk_mb: int | None = 1024
    cpus: float | None = None
    output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("memory_mb", "cpu_seconds", "file_mb", "open_files", "processes", "disk_mb"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigurationError(f"Limits({name}={value!r}): give a positive whole number, or None for no limit")
        if self.cpus is not None and (isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float))
                                      or not 0.01 <= self.cpus <= 1024):
            raise ConfigurationError(f"Limits(cpus={self.cpus!r}): give the CPU share in cores (0.5, 2), or None")
        if not isinstance(self.output_bytes, int) or self.output_bytes < 0:
            raise ConfigurationError(f"Limits(output_bytes={self.output_bytes!r}): give a number of bytes >= 0")

    def apply(self) -> None:
        """Set the limits on this process (run in the child, before the command starts)."""
        pairs = ((resource.RLIMIT_AS, self.memory_mb and self.memory_mb << 20),
                 (resource.RLIMIT_CPU, self.cpu_seconds), (resource.RLIMIT_FSIZE, self.file_mb and self.file_mb << 20),
                 (resource.RLIMIT_NOFILE, self.open_files), (resource.RLIMIT_NPROC, self.processes))
        for which, value in pairs:
            if value is not None:
                resource.setrlimit(which, (value, value))


@dataclass(frozen=True, slots=True)
class RunResult:
    """One command's run in a sandbox."""

    exit_code: int | None  # None when it did not exit by itself (a signal, the deadline)
    stdout: str
    stderr: str
    duration: float  # seconds
    ended: str  # one of ENDINGS
    signal: int | None = None
    truncated_bytes: int = 0  # output past Limits.output_bytes, not kept

    @property
    def ok(self) -> bool:
        return self.ended == "exit" and self.exit_code == 0


@runtime_checkable
class Sandbox(Protocol):
    """One try's sandbox: ``folder`` is its writable working folder on the host (what ``put``/``get`` address,
    relative to it), seen inside as ``workdir``."""

    folder: Path
    workdir: str

    def run(self, argv: Sequence[str], *, stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0) -> RunResult: ...

    def put(self, path: str, data: bytes | str) -> None: ...

    def get(self, path: str) -> bytes: ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...


def run_process(argv: Sequence[str], *, stdin: bytes | str | None, env: Mapping[str, str], cwd: str | None,
                timeout: float, limits: Limits, prepare: Callable[[], None] | None = None,
                pass_fds: Sequence[int] = ()) -> RunResult:
    """Run ``argv`` in a new session (its own process group) with ``limits``; at ``timeout`` seconds kill the group
    (SIGKILL: a command that ignores SIGTERM ends too). ``prepare`` runs in the child first (a backend's namespace
    set-up), ``pass_fds`` stay open in it."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ConfigurationError(f"timeout={timeout!r}: give the command's deadline in seconds, > 0")
    data = stdin.encode() if isinstance(stdin, str) else stdin
    started = time.monotonic()
    try:
        with exec_after_fork():  # the child only sets itself up and execs: the stores are not re-opened in it
            proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(env), cwd=cwd,
                                    start_new_session=True, pass_fds=tuple(pass_fds),
                                    preexec_fn=limits.apply if prepare is None else lambda: (prepare(), limits.apply()))
    except OSError as exc:
        raise SandboxError(f"could not start {argv[0]!r}: {exc}") from exc
    kept: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
    dropped = [0]

    def drain(stream, key: str) -> None:
        while chunk := stream.read(65536):
            room = limits.output_bytes - len(kept[key])
            kept[key] += chunk[:max(room, 0)]
            dropped[0] += max(len(chunk) - max(room, 0), 0)
        stream.close()

    readers = [threading.Thread(target=drain, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, "err"), daemon=True)]
    for reader in readers:
        reader.start()
    if data is not None:
        try:
            proc.stdin.write(data)
        except BrokenPipeError:
            pass
        finally:
            proc.stdin.close()
    ended = "exit"
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        ended = "deadline"
        count("sandbox_killed_at_deadline")
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for reader in readers:
        reader.join(5.0)
    code = proc.returncode
    if dropped[0]:
        count("sandbox_output_cut_bytes", dropped[0])
    if ended == "exit" and code < 0:
        ended = "signal"
    return RunResult(exit_code=code if ended == "exit" else None, stdout=kept["out"].decode(errors="replace"),
                     stderr=kept["err"].decode(errors="replace"), duration=time.monotonic() - started, ended=ended,
                     signal=-code if code is not None and code < 0 else None, truncated_bytes=dropped[0])


def inside(folder: Path, path: str) -> Path:
    """``path`` (relative to ``folder``) on the host, refused when it would leave ``folder``."""
    target = (folder / path).resolve()
    if target != folder.resolve() and folder.resolve() not in target.parents:
        raise ConfigurationError(f"{path!r} leaves the sandbox's folder; give a path inside it")
    return target
