"""Container sandbox backends: ``docker`` (Debian's docker.io) and ``podman``, one class with the CLI's name as a
parameter. One long-lived container per sandbox, started when the sandbox is made and removed at ``close``: the
image's root read-only, a private ``/tmp`` (tmpfs), the try's own copy of its folder bind-mounted writable at
``/work``, no network (``--network none``; ``network=True`` shares the host's, as bwrap's ``--share-net`` does),
every capability dropped, no new privileges, the host's uid. Each command is a ``<cli> exec`` of
``env -i ... prlimit ... -- argv``: a clean environment and the same per-process limits as bwrap's; the container
holds memory, processes and CPU for the whole try (``--memory``, ``--pids-limit``, ``--cpus``).

At the deadline killing the ``exec`` client does not end what it started inside, so after a command (at the
deadline, or when something it started is still running) every process of the container but its init and its
keeper (``sleep infinity``) is killed from inside, and ``<cli> top`` must then show those two only; if it does not
the container is removed (the sandbox is then no longer ``alive``). Commands of one sandbox run one at a time.

The image has no registry to come from: it is made from Debian by debootstrap and imported
(``container_available`` says how when it is missing). Importing this module registers both backends."""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import subprocess
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from .backends import _FolderSandbox, register_sandbox_backend
from .layers import disk_usage
from .base import ENDINGS, Limits, RunResult, SandboxError, run_process

#: The image every container sandbox starts from unless told otherwise (built locally, see ``IMAGE_RECIPE``).
DEFAULT_IMAGE = "lightning-rl-sandbox:base"
#: The label on every container these backends start (``docker rm -f $(docker ps -aq --filter label=...)`` sweeps
#: what a killed process left behind).
LABEL = "lightning-rl.sandbox"
#: How the default image is made without a registry (what ``container_available`` points to when it is missing).
IMAGE_RECIPE = ("debootstrap --variant=minbase --include=python3 bookworm /tmp/lrl-rootfs http://deb.debian.org/debian"
                " && tar -C /tmp/lrl-rootfs -c . | {cli} import - " + DEFAULT_IMAGE)
#: What installs each CLI on Debian, and what starts its daemon (podman has none).
INSTALL = {"docker": "apt-get install docker.io", "podman": "apt-get install podman uidmap"}
START = {"docker": "dockerd --iptables=false --ip-forward=false --ip-masq=false --bridge=none "
                   ">/var/log/dockerd.log 2>&1 &"}
#: The keeper: PID 1's only child, what keeps the container running between commands.
KEEPER = "echo $$ > /tmp/.lrl-keeper; exec sleep infinity"
#: Run inside after a command: kill every process but init (1), the keeper ($1) and this shell, until none is left.
SWEEP = """keep=$1; i=0
while [ $i -lt 5000 ]; do
  left=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case $p in 1|$keep|$$) continue;; esac
    kill -9 $p 2>/dev/null && left=1
  done
  [ $left = 0 ] && exit 0
  i=$((i+1))
done
exit 1"""


def _cli(cli: str, args: Sequence[str], timeout: float = 120.0, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """``cli args`` (``cwd``: where it runs; podman's conmon stays there and writes an ``oom`` file into it when the
    container is OOM-killed, so a container's CLI runs in the sandbox's own folder, never the caller's)."""
    try:
        return subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess([cli, *args], 124, "",
                                           f"{cli} {args[0]} did not answer in {exc.timeout:.0f} s")
    except OSError as exc:
        return subprocess.CompletedProcess([cli, *args], 127, "", f"{cli} could not run ({exc})")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "(no output)")[:300]


def _hard_limit(which: int) -> int | None:
    hard = resource.getrlimit(which)[1]
    return None if hard == resource.RLIM_INFINITY else hard


def container_available(cli: str = "docker", image: str = DEFAULT_IMAGE) -> str | None:
    """None when ``cli`` (docker or podman) can start a container of ``image`` here, else one line: what is missing
    and the fix."""
    if shutil.which(cli) is None:
        return f"{cli} is not installed (no {cli} on PATH): {INSTALL.get(cli, 'install it')}"
    found = _cli(cli, ["image", "inspect", "--format", "{{.Id}}", image], timeout=60)
    if found.returncode != 0:
        error = _first_line(found.stderr)
        if "no such" in error.lower() or "not known" in error.lower() or "unknown image" in error.lower():
            return (f"the image {image} is not in {cli}'s store: build it (no registry needed): "
                    + IMAGE_RECIPE.format(cli=cli))
        fix = f"start the daemon: {START[cli]}" if cli in START else f"see {cli} info"
        return f"{cli} cannot reach its engine ({error}): {fix}"
    trial = _cli(cli, ["run", "--rm", "--pull", "never", "--network", "none", *_ulimits(), image, "true"],
                 timeout=120)
    if trial.returncode != 0:
        return f"{cli} cannot start a container of {image} here ({_first_line(trial.stderr)})"
    return None


def _ulimits() -> list[str]:
    """The container's own resource limits: the host's hard limits, processes at most 32768 (podman's defaults,
    and even the host's own process limit, are more than runc may set on a machine without CAP_SYS_RESOURCE: there
    no container starts, "error setting rlimit type 6/7: operation not permitted")."""
    out = []
    for name, which, most in (("nofile", resource.RLIMIT_NOFILE, None), ("nproc", resource.RLIMIT_NPROC, 32768)):
        hard = _hard_limit(which)
        if hard is not None or most is not None:
            value = min(v for v in (hard, most) if v is not None)
            out += ["--ulimit", f"{name}={value}:{value}"]
    return out


@register_sandbox_backend("docker")
class ContainerSandbox(_FolderSandbox):
    """A try in its own container (see the module's docstring). ``cli``: ``docker`` or ``podman``; ``image``: what
    it starts from (python3 and util-linux's prlimit in it); ``cpus`` and ``pids``: used when ``limits`` says
    nothing of them."""

    cli = "docker"
    layered = False  # the container sees a copy of the task, bind-mounted

    def __init__(self, source: str | os.PathLike[str] | None = None, *, limits: Limits | None = None,
                 network: bool = False, image: str = DEFAULT_IMAGE, cli: str | None = None, cpus: float | None = 1.0,
                 pids: int | None = 512, **kwargs: Any) -> None:
        self.cli = cli or type(self).cli
        if shutil.which(self.cli) is None:
            why = container_available(self.cli, image)
            raise SandboxError(f"the {self.cli} sandbox backend cannot run here: {why}")
        super().__init__(source, limits=limits, **{k: v for k, v in kwargs.items() if v is not None})
        self.network, self.image = network, image
        self.cpus = getattr(self.limits, "cpus", None) or cpus
        self.pids = getattr(self.limits, "processes", None) or pids
        self.user = f"{os.getuid()}:{os.getgid()}"
        self.name = ""
        self.keeper = ""
        self.broken: str | None = None  # why the container is gone, when it is
        self._lock = threading.Lock()
        self._mounted: tuple[int, int] | None = None
        try:
            self._start()
        except BaseException:
            _FolderSandbox.close(self)
            raise

    # -- the container

    def _start(self) -> None:
        """Start this sandbox's container (again, when its folder was replaced: a bind mount follows the folder it
        was made of, not its path)."""
        if self.name:
            _cli(self.cli, ["rm", "-f", self.name], timeout=60)
        self.name = f"lrl-sandbox-{uuid.uuid4().hex[:16]}"
        tmp = "/tmp:rw,exec,nosuid,nodev,mode=1777"
        disk_mb = getattr(self.limits, "disk_mb", None)
        if disk_mb is not None:
            tmp += f",size={disk_mb}m"
        args = ["run", "-d", "--pull", "never", "--name", self.name, "--label", f"{LABEL}=1", "--init",
                "--user", self.user,
                "--hostname", "sandbox", "--network", "host" if self.network else "none", "--read-only",
                "--tmpfs", tmp, "--cap-drop", "ALL", "--security-opt", "no-new-privileges", *_ulimits(),
                "-v", f"{self.folder}:{self.workdir}", "-w", self.workdir]
        if self.limits.memory_mb is not None:
            args += ["--memory", f"{self.limits.memory_mb}m"]
        if self.pids is not None:
            args += ["--pids-limit", str(self.pids)]
        if self.cpus is not None:
            args += ["--cpus", str(self.cpus)]
        started = _cli(self.cli, [*args, self.image, "sh", "-c", KEEPER], cwd=str(self.root))
        if started.returncode != 0:
            _cli(self.cli, ["rm", "-f", self.name], timeout=60)
            why = container_available(self.cli, self.image) or _first_line(started.stderr)
            raise SandboxError(f"the {self.cli} sandbox could not start its container: {why}")
        keeper = _cli(self.cli, ["exec", self.name, "cat", "/tmp/.lrl-keeper"], timeout=60)
        if keeper.returncode != 0 or not keeper.stdout.strip().isdigit():
            _cli(self.cli, ["rm", "-f", self.name], timeout=60)
            raise SandboxError(f"the {self.cli} sandbox's container did not start its keeper: "
                               f"{_first_line(keeper.stderr)}")
        self.keeper = keeper.stdout.strip()
        stat = self.folder.stat()
        self._mounted = (stat.st_dev, stat.st_ino)
        self.broken = None

    def _running(self) -> bool:
        done = _cli(self.cli, ["inspect", "--format", "{{.State.Running}}", self.name], timeout=60)
        return done.returncode == 0 and done.stdout.strip() == "true"

    def processes(self) -> list[str]:
        """The container's processes as ``<cli> top`` lists them (one line each, header dropped); [] when it is not
        running."""
        done = _cli(self.cli, ["top", self.name], timeout=60)
        if done.returncode != 0:
            return []
        return [line for line in done.stdout.splitlines()[1:] if line.strip()]

    def _sweep(self) -> None:
        """Kill what a command left running; when ``top`` still shows more than init and the keeper, remove the
        container."""
        for _ in range(3):
            _cli(self.cli, ["exec", "-u", self.user, self.name, "sh", "-c", SWEEP, "sweep", self.keeper], timeout=60)
            if len(self.processes()) <= 2:
                return
        _cli(self.cli, ["rm", "-f", self.name], timeout=60)
        self.broken = "a command's processes outlived their deadline and the container was removed"

    # -- the protocol

    def run(self, argv: Sequence[str], *, stdin: bytes | str | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60.0) -> RunResult:
        self._check_open()
        if not argv:
            raise ConfigurationError("argv is empty; give the command and its arguments, e.g. ['python3', 'test.py']")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigurationError(f"timeout={timeout!r}: give the command's deadline in seconds, > 0")
        environment = self._env(env, self.workdir)
        for key in environment:
            if not key or "=" in key:
                raise ConfigurationError(f"environment name {key!r}: give a name without '='")
        with self._lock:
            if self.broken:
                raise SandboxError(f"this {self.cli} sandbox's container is gone ({self.broken}); take a new one")
            stat = self.folder.stat()
            if (stat.st_dev, stat.st_ino) != self._mounted:  # the folder was replaced (a reset): mount the new one
                self._start()
            command = [self.cli, "exec", *(["-i"] if stdin is not None else []), "-u", self.user,
                       "-w", cwd or self.workdir, self.name, "/usr/bin/env", "-i",
                       *(f"{key}={value}" for key, value in environment.items()), "/usr/bin/prlimit",
                       *self._prlimits(), "--", *argv]
            # The limits hold the command inside, not the exec client (a Go program under RLIMIT_AS may not start).
            client = dataclasses.replace(self.limits, **{field.name: None for field in dataclasses.fields(self.limits)
                                                         if field.name != "output_bytes"})
            done = run_process(command, stdin=stdin, env=os.environ, cwd=str(self.folder), timeout=timeout,
                               limits=client)
            if done.ended == "deadline" or len(self.processes()) > 2:
                self._sweep()
            if done.ended == "exit" and done.exit_code != 0 and not self._running():
                self.broken = self.broken or f"the container stopped ({_first_line(done.stderr)})"
                raise SandboxError(f"this {self.cli} sandbox's container is gone ({self.broken}); take a new one")
        disk_mb = getattr(self.limits, "disk_mb", None)
        if (disk_mb is not None and "disk" in ENDINGS and done.ended == "exit"
                and disk_usage(self.folder) > disk_mb << 20):
            done = dataclasses.replace(done, ended="disk")
        return done

    def _prlimits(self) -> list[str]:
        limits = self.limits
        pairs = (("as", limits.memory_mb and limits.memory_mb << 20), ("cpu", limits.cpu_seconds),
                 ("fsize", limits.file_mb and limits.file_mb << 20), ("nofile", limits.open_files))
        return [f"--{name}={value}" for name, value in pairs if value is not None]

    def alive(self) -> bool:
        return super().alive() and not self.broken and self._running()

    def close(self) -> None:
        if self.name:
            _cli(self.cli, ["rm", "-f", self.name], timeout=120)
        super().close()


@register_sandbox_backend("podman")
class PodmanSandbox(ContainerSandbox):
    """The same container sandbox through podman (no daemon)."""

    cli = "podman"
