"""The sandbox backends: ``bwrap`` (Debian's bubblewrap: namespaces, the default) and ``local`` (a folder, no
isolation: by name only, for debugging), on one registry (``SANDBOX_BACKENDS``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..registry import Registry
from .base import Limits, RunResult, SandboxError, inside, run_process

SANDBOX_BACKENDS: Registry[Any] = Registry("sandbox backend", hint="or register one with register_sandbox_backend")
register_sandbox_backend = SANDBOX_BACKENDS.register

#: What a command sees by default: a PATH of the system's folders, a home of its own (its working folder).
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
#: The system folders a bwrap sandbox sees, read-only (merged-/usr symlinks are kept as symlinks).
SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: Host files under those folders a sandbox must not read (as root it would own them): masked.
MASKED = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")
MASKED_FOLDERS = ("/etc/ssh", "/etc/sudoers.d", "/etc/ssl/private")


class _FolderSandbox:
    """What both backends share: the try's own writable folder (a copy of ``source``), put/get, close."""

    workdir = "/work"

    def __init__(self, source: str | os.PathLike[str] | None = None, *, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.root = Path(tempfile.mkdtemp(prefix="lrl-sandbox-"))
        self.folder = self.root / "work"
        if source is None:
            self.folder.mkdir()
        else:
            source = Path(source)
            if not source.is_dir():
                shutil.rmtree(self.root, ignore_errors=True)
                raise ConfigurationError(f"sandbox folder {str(source)!r} is not a readable folder; give the task's folder")
            shutil.copytree(source, self.folder, symlinks=True)
        self.closed = False

    def put(self, path: str, data: bytes | str) -> None:
        target = inside(self.folder, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    def get(self, path: str) -> bytes:
        return inside(self.folder, path).read_bytes()

    def alive(self) -> bool:
        return not self.closed and self.folder.is_dir()

    def close(self) -> None:
        self.closed = True
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "_FolderSandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _env(self, env: Mapping[str, str] | None, home: str) -> dict[str, str]:
        out = {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8"}
        out.update(env or {})
        return out

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError("this sandbox is closed; take a new one")


@register_sandbox_backend("local")
class LocalSandbox(_FolderSandbox):
    """A folder of its own and nothing else: the command runs on the host as this user, sees everything, reaches the
    network, and what it double-forks can outlive the deadline. Only when asked for by name, for debugging."""

    def __init__(self, source: str | os.PathLike[str] | None = None, *, limits: Limits | None = None) -> None:
        super().__init__(source, limits=limits)
        self.workdir = str(self.folder)

    def run(self, argv: Sequence[str], *, stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0) -> RunResult:
        self._check_open()
        return run_process(argv, stdin=stdin, env=self._env(env, str(self.folder)), cwd=cwd or str(self.folder),
                           timeout=timeout, limits=self.limits)


def bwrap_available() -> str | None:
    """None when bubblewrap runs here, else one line: what is missing and the fix."""
    binary = shutil.which("bwrap")
    if binary is None:
        return "bubblewrap is not installed (no bwrap on PATH): apt-get install bubblewrap (make all installs it)"
    try:
        done = subprocess.run([binary, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "--", "true"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run ({exc})"
    if done.returncode != 0:
        return (f"bwrap cannot make its namespaces here ({done.stderr.strip()[:200]}): user namespaces may be off "
                "(sysctl kernel.unprivileged_userns_clone=1, or run as root)")
    return None


@register_sandbox_backend("bwrap")
class BwrapSandbox(_FolderSandbox):
    """bubblewrap: the system's folders read-only, the try's own copy of its folder writable at ``/work``, a private
    ``/tmp``; its own PID, IPC, UTS, network and mount namespaces (no network unless ``network=True``); no home, no
    store, no secret of the host (nothing of the host is bound but the system folders, with ``MASKED`` hidden); a
    clean environment. At the deadline bwrap is killed and, as the PID namespace's parent, takes every process of
    the try with it (what double-forked or ignores SIGTERM too)."""

    def __init__(self, source: str | os.PathLike[str] | None = None, *, limits: Limits | None = None,
                 network: bool = False) -> None:
        missing = bwrap_available()
        if missing:
            raise SandboxError(f"the bwrap sandbox backend cannot run here: {missing}")
        super().__init__(source, limits=limits)
        self.network = network

    def command(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None) -> list[str]:
        """The bwrap command line that runs ``argv`` in this sandbox."""
        args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all", "--hostname", "sandbox"]
        if self.network:
            args.append("--share-net")
        for folder in SYSTEM_FOLDERS:
            if os.path.islink(folder):
                args += ["--symlink", os.readlink(folder), folder]
            elif os.path.isdir(folder):
                args += ["--ro-bind", folder, folder]
        for path in MASKED:
            if os.path.exists(path):
                args += ["--ro-bind", "/dev/null", path]
        for folder in MASKED_FOLDERS:
            if os.path.isdir(folder):
                args += ["--tmpfs", folder]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(self.folder), self.workdir,
                 "--chdir", cwd or self.workdir, "--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return [*args, "--", *argv]

    def run(self, argv: Sequence[str], *, stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0) -> RunResult:
        self._check_open()
        if not argv:
            raise ConfigurationError("argv is empty; give the command and its arguments, e.g. ['python3', 'test.py']")
        return run_process(self.command(argv, self._env(env, self.workdir), cwd), stdin=stdin, env={},
                           cwd=str(self.folder), timeout=timeout, limits=self.limits)


def open_sandbox(backend: str = "bwrap", source: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
    """A new sandbox of ``backend`` (``bwrap``, the default; ``local`` by name only) with its own copy of ``source``."""
    return SANDBOX_BACKENDS.get(backend)(source, **kwargs)
