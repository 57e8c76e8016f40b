"""The sandbox backends: ``bwrap`` (Debian's bubblewrap: namespaces, the default) and ``local`` (a folder, no
isolation: by name only, for debugging), on one registry (``SANDBOX_BACKENDS``)."""

from __future__ import annotations

import dataclasses
import filecmp
import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..registry import Registry
from ..forks import exec_after_fork
from .base import Limits, RunResult, SandboxError, inside, run_process
from .cgroups import RunGroup, cgroup_bases
from .layers import Layers, Snapshot, disk_usage, mount_overlay_in_child, overlay_options, relative_parts

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
    """What both backends share: the try's own view of its task (a snapshot, a copy of a folder, or an empty
    folder), put/get, restore and reset, close. ``folder`` holds the try's writes on the host."""

    workdir = "/work"
    layered = False  # whether this backend sees a snapshot through an overlay (else: a copy of it)

    def __init__(self, source: str | os.PathLike[str] | None = None, *, snapshot: Snapshot | None = None,
                 limits: Limits | None = None, in_place: Path | None = None) -> None:
        if source is not None and snapshot is not None:
            raise ConfigurationError("give a sandbox a task folder or a snapshot, not both (a snapshot is made from "
                                     "the folder: Snapshot(folder))")
        if snapshot is not None and snapshot.closed:
            raise ConfigurationError("that snapshot is closed; make it again (Snapshot(folder, setup=...))")
        self.limits = limits or Limits()
        self._own_snapshot = Snapshot(source) if source is not None else None
        self.snapshot = snapshot or self._own_snapshot
        self.root = Path(tempfile.mkdtemp(prefix="lrl-sandbox-"))
        self.layers: Layers | None = None
        if in_place is not None:  # a snapshot's setup: its folder itself
            self.folder = in_place
        elif self.layered and self.snapshot is not None and overlay_available() is None:
            self.folder = self.root / "upper"
            for name in ("upper", "ovwork", "merged"):
                (self.root / name).mkdir()
            self.layers = Layers(self.snapshot.path, self.folder, privileged=os.getuid() == 0)
        else:
            self.folder = self.root / "work"
            self._fill()
        self.closed = False

    def _fill(self) -> None:
        if self.snapshot is None:
            self.folder.mkdir()
        else:
            shutil.copytree(self.snapshot.path, self.folder, symlinks=True)

    def put(self, path: str, data: bytes | str) -> None:
        """Write a file of the try (between its commands)."""
        self._check_open()
        if self.layers is not None:
            target = self.layers.writable(path)
        else:
            target = inside(self.folder, path)
            target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    def get(self, path: str) -> bytes:
        """A file as the try sees it (between its commands)."""
        self._check_open()
        return (self.layers.seen(path) if self.layers is not None else inside(self.folder, path)).read_bytes()

    def put_folder(self, source: str | os.PathLike[str], path: str) -> None:
        """Copy a host folder into the try's folder at ``path``."""
        for folder, _, names in os.walk(source):
            for name in names:
                full = os.path.join(folder, name)
                self.put(os.path.relpath(full, source) if path in ("", ".") else
                         f"{path}/{os.path.relpath(full, source)}", Path(full).read_bytes())

    def get_folder(self, path: str, target: str | os.PathLike[str]) -> None:
        """Copy a folder as the try sees it to ``target`` on the host (created)."""
        self._check_open()
        if self.layers is not None:
            self.layers.export(path, Path(target))
        else:
            shutil.copytree(inside(self.folder, path), target, symlinks=True)

    def restore(self, paths: Sequence[str]) -> list[str]:
        """Put back the task's own version of each path (a file or a folder; tests, ``.git``) before a reward runs
        here: no try edits its way to a reward. Returns the paths the try had changed."""
        self._check_open()
        if self.snapshot is None:
            raise ConfigurationError("restore needs the task's files: open the sandbox on a folder or a snapshot")
        if self.layers is not None:
            return self.layers.restore(paths)
        changed = []
        for path in paths:
            relative_parts(path)
            mine, theirs = inside(self.folder, path), self.snapshot.path / path
            if os.path.lexists(mine):
                if theirs.exists() and _same_tree(mine, theirs):
                    continue
                shutil.rmtree(mine) if mine.is_dir() and not mine.is_symlink() else mine.unlink()
            elif not os.path.lexists(theirs):
                continue
            if os.path.lexists(theirs):
                mine.parent.mkdir(parents=True, exist_ok=True)
                if theirs.is_dir() and not theirs.is_symlink():
                    shutil.copytree(theirs, mine, symlinks=True)
                else:
                    shutil.copy2(theirs, mine, follow_symlinks=False)
            changed.append(path)
        return changed

    def reset(self) -> float:
        """Forget every write of the try (a pooled sandbox's next try starts from the task as made); returns the
        seconds it took."""
        self._check_open()
        began = time.monotonic()
        if self.layers is not None:
            self.layers.reset(self.root / "ovwork")
        else:
            shutil.rmtree(self.folder, ignore_errors=True)
            self._fill()
        return time.monotonic() - began

    def alive(self) -> bool:
        return not self.closed and self.folder.is_dir() and (self.snapshot is None or not self.snapshot.closed)

    def close(self) -> None:
        self.closed = True
        shutil.rmtree(self.root, ignore_errors=True)
        if self._own_snapshot is not None:
            self._own_snapshot.close()
        bridge = getattr(self, "bridge", None)
        if bridge is not None:
            bridge.close()

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


def _same_tree(a: Path, b: Path) -> bool:
    if a.is_symlink() or b.is_symlink():
        return a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
    if a.is_dir() and b.is_dir():
        names = sorted(os.listdir(a))
        return names == sorted(os.listdir(b)) and all(_same_tree(a / n, b / n) for n in names)
    return a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False)


@register_sandbox_backend("local")
class LocalSandbox(_FolderSandbox):
    """A folder of its own and nothing else: the command runs on the host as this user, sees everything, reaches the
    network, and what it double-forks can outlive the deadline. Only when asked for by name, for debugging."""

    def __init__(self, source: str | os.PathLike[str] | None = None, *, snapshot: Snapshot | None = None,
                 limits: Limits | None = None, in_place: Path | None = None, network: bool = True) -> None:
        super().__init__(source, snapshot=snapshot, limits=limits, in_place=in_place)
        self.workdir = str(self.folder)

    def run(self, argv: Sequence[str], *, stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0) -> RunResult:
        self._check_open()
        return run_process(argv, stdin=stdin, env=self._env(env, str(self.folder)), cwd=cwd or str(self.folder),
                           timeout=timeout, limits=self.limits)


@functools.cache
def overlay_available() -> str | None:
    """None when a try's copy-on-write overlay can be mounted here (probed once), else one line: why and the fix.
    Without it a sandbox from a snapshot gets a full copy of it (slower to open and reset; the same isolation)."""
    root = Path(tempfile.mkdtemp(prefix="lrl-overlay-probe-"))
    try:
        for name in ("lower", "upper", "work", "merged"):
            (root / name).mkdir()
        options = overlay_options(root / "lower", root / "upper", root / "work", os.getuid() == 0)
        with exec_after_fork():
            done = subprocess.run(["true"], preexec_fn=lambda: mount_overlay_in_child(options, root / "merged"),
                                  capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            return (f"{done.stderr.strip()[:300]}: overlayfs in a user namespace needs Linux >= 5.11 with user "
                    "namespaces on (sysctl kernel.unprivileged_userns_clone=1), or run as root")
        return None
    except (OSError, subprocess.SubprocessError, ConfigurationError) as exc:
        return f"the overlay probe could not run ({exc})"
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
    """bubblewrap: the system's folders read-only, the try's own view of its task writable at ``/work`` (a
    copy-on-write overlay of its snapshot), a private ``/tmp``; its own PID, IPC, UTS, network and mount namespaces
    (no network unless ``network=True``); no home, no store, no secret of the host (nothing of the host is bound but
    the system folders, with ``MASKED`` hidden, and ``binds``, read-only); a clean environment. At the deadline bwrap
    is killed and, as the PID namespace's parent, takes every process of the try with it (what double-forked or
    ignores SIGTERM too). ``binds``: host paths the try may read (a CLI's installation), at the same path."""

    layered = True

    def __init__(self, source: str | os.PathLike[str] | None = None, *, snapshot: Snapshot | None = None,
                 limits: Limits | None = None, network: bool = False, in_place: Path | None = None,
                 binds: Sequence[str] = (), sockets: Mapping[str, str] | None = None, gateway: str | None = None) -> None:
        missing = bwrap_available()
        if missing:
            raise SandboxError(f"the bwrap sandbox backend cannot run here: {missing}")
        if gateway is not None and network:
            raise ConfigurationError("network=True gives the host's network, gateway= only the gateway: choose one")
        from .bridge import INSIDE_FOLDER, UnixBridge, host_port

        address = host_port(gateway) if gateway is not None else None  # refused before anything is made
        super().__init__(source, snapshot=snapshot, limits=limits, in_place=in_place)
        self.network = network
        self.binds = tuple(binds)
        self.sockets = dict(sockets or {})  # a host folder -> its path inside (the gateway's bridge)
        #: ``gateway`` (a URL): every command runs behind the relay, the gateway its only address
        self.bridge = None
        if address is not None:
            try:
                self.bridge = UnixBridge(*address)
            except BaseException:
                self.close()
                raise
            self.sockets[str(self.bridge.folder)] = INSIDE_FOLDER

    def command(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, status_fd: int | None = None,
                binds: Mapping[str, str] | None = None, read_only: Sequence[str] = ()) -> list[str]:
        """The bwrap command line that runs ``argv`` in this sandbox (``binds``: host folder -> path inside, for
        this command; ``read_only``: host paths it may read, at the same path)."""
        args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all", "--hostname", "sandbox"]
        if status_fd is not None:
            args += ["--json-status-fd", str(status_fd)]
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
        mine = self.root / "merged" if self.layers is not None else self.folder
        args += ["--proc", "/proc", "--dev", "/dev"]
        if self.limits.disk_mb is not None:
            args += ["--size", str(self.limits.disk_mb << 20)]
        args += ["--tmpfs", "/tmp", "--bind", str(mine), self.workdir]
        for path in (*self.binds, *read_only):
            args += ["--ro-bind", path, path]
        for host_path, inside_path in {**self.sockets, **(binds or {})}.items():
            args += ["--bind", host_path, inside_path]
        args += ["--chdir", cwd or self.workdir, "--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return [*args, "--", *argv]

    def launch(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None, status_fd: int,
               binds: Mapping[str, str] | None = None, read_only: Sequence[str] = ()) -> tuple[list[str], Any, Any]:
        """What starting ``argv`` here takes: the bwrap command line, the function its child runs before exec (its
        control group, the overlay) and the one to call after it ended (the group removed)."""
        self._check_open()
        if not argv:
            raise ConfigurationError("argv is empty; give the command and its arguments, e.g. ['python3', 'test.py']")
        options = merged = None
        if self.layers is not None:
            options = overlay_options(self.layers.lower, self.layers.upper, self.root / "ovwork", os.getuid() == 0)
            merged = self.root / "merged"
        limits = self.limits
        group = RunGroup(limits.processes, limits.memory_mb, limits.cpus) if cgroup_bases() else None
        if group is not None and "memory" in cgroup_bases():
            # the group holds memory: no address-space limit, which runtimes that reserve address space up front (Bun:
            # opencode, Claude Code; Go; the JVM) cannot start under
            limits = dataclasses.replace(limits, memory_mb=None)

        def prepare() -> None:
            if group is not None:
                group.join()
            if options is not None:
                mount_overlay_in_child(options, merged)
            limits.apply()

        if self.bridge is not None and not (binds and any(p.startswith("/run/lightning-rl") for p in binds.values())):
            argv = self.bridge.wrap(list(argv))
        full = self.command(argv, self._env(env, self.workdir), cwd, status_fd=status_fd, binds=binds,
                            read_only=read_only)
        return full, prepare, (group.close if group is not None else (lambda: None))

    def run(self, argv: Sequence[str], *, stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0) -> RunResult:
        read, write = os.pipe()
        cleanup = None
        try:
            full, prepare, cleanup = self.launch(argv, env, cwd, write)
            done = run_process(full, stdin=stdin, env={}, cwd=str(self.root), timeout=timeout,
                               limits=dataclasses.replace(self.limits, **UNLIMITED), prepare=prepare, pass_fds=(write,))
            os.close(write)
            write = -1
            status = read_status(read)
        finally:
            if write >= 0:
                os.close(write)
            os.close(read)
            if cleanup is not None:
                cleanup()
        if b"child-pid" not in status and done.ended != "deadline":  # bwrap never started the command
            raise SandboxError(f"the bwrap sandbox could not start the command (exit {done.exit_code}): "
                               f"{done.stderr.strip()[-500:] or '(no output)'}")
        limits = self.limits
        if limits.disk_mb is not None and done.ended == "exit" and disk_usage(self.folder) > limits.disk_mb << 20:
            done = dataclasses.replace(done, ended="disk")
        return done


#: The resource limits ``launch``'s ``prepare`` has already set (run_process keeps only the output cap).
UNLIMITED = {"memory_mb": None, "cpu_seconds": None, "file_mb": None, "open_files": None, "processes": None}


def read_status(read: int) -> bytes:
    """What bwrap wrote to its status pipe (read after it ended; the write end closed)."""
    os.set_blocking(read, False)
    try:
        return os.read(read, 65536)
    except BlockingIOError:
        return b""


def open_sandbox(backend: str = "bwrap", source: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
    """A new sandbox of ``backend`` (``bwrap``, the default; ``local`` by name only) with its own view of ``source``
    (a task folder) or of ``snapshot=`` (a :class:`Snapshot`, prepared once)."""
    return SANDBOX_BACKENDS.get(backend)(source, **kwargs)
