"""Control groups for a try's command: processes, memory and CPU share held by the kernel for the whole tree
(a fork storm stops at ``Limits.processes``; resource limits alone do not hold a root user's processes).

One group per command's run, made under this process's own groups (cgroup v2 where its controllers are delegated,
else the v1 hierarchies ``pids``, ``memory`` and ``cpu``), joined by the command's child before it execs, removed
after the run. Where no hierarchy can be written (an unprivileged user without delegation), the limits fall back to
resource limits, and ``sandbox doctor`` says so.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1 = ("pids", "memory", "cpu")


def _own_path(controller: str) -> str:
    """This process's group in a v1 hierarchy (``controller``) or in v2 (``""``)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path
    return "/"


def _writable(folder: Path) -> bool:
    probe = folder / f"lrl-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    probe.rmdir()
    return True


@functools.cache
def cgroup_bases() -> dict[str, Path]:
    """Where this process may make groups, by controller (``pids``, ``memory``, ``cpu``); empty when nowhere."""
    v2 = CGROUP_ROOT / "cgroup.controllers"
    if v2.is_file():
        base = CGROUP_ROOT / _own_path("").lstrip("/")
        try:
            enabled = set((base / "cgroup.subtree_control").read_text().split())
        except OSError:
            enabled = set()
        if _writable(base):
            return {c: base for c in _V1 if c in enabled}
        return {}
    found = {}
    for controller in _V1:
        base = CGROUP_ROOT / controller / _own_path(controller).lstrip("/")
        if base.is_dir() and _writable(base):
            found[controller] = base
    return found


def cgroups_missing() -> str | None:
    """None when processes, memory and CPU are held by control groups here, else one line: what and the fix."""
    have = cgroup_bases()
    missing = [c for c in _V1 if c not in have]
    if not missing:
        return None
    return (f"no writable control group for {', '.join(missing)} (this user cannot make groups under "
            f"{CGROUP_ROOT}); those limits fall back to resource limits, which do not hold root's processes: run as "
            "root, or under systemd-run --user --scope -p Delegate=yes")


class RunGroup:
    """The groups of one command's run: made with the limits, joined by the child (``join``), removed by ``close``."""

    def __init__(self, processes: int | None, memory_mb: int | None, cpus: float | None) -> None:
        self.folders: list[Path] = []
        name = f"lrl-sandbox-{uuid.uuid4().hex[:12]}"
        bases = cgroup_bases()
        v2 = (CGROUP_ROOT / "cgroup.controllers").is_file()
        wanted = {"pids": processes, "memory": memory_mb, "cpu": cpus}
        made: dict[Path, Path] = {}
        try:
            for controller, value in wanted.items():
                base = bases.get(controller)
                if value is None or base is None:
                    continue
                folder = made.get(base)
                if folder is None:
                    folder = made[base] = base / name
                    folder.mkdir()
                    self.folders.append(folder)
                if controller == "pids":
                    (folder / "pids.max").write_text(str(value))
                elif controller == "memory":
                    (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(value << 20))
                    if v2:
                        (folder / "memory.swap.max").exists() and (folder / "memory.swap.max").write_text("0")
                else:
                    period = 100_000
                    if v2:
                        (folder / "cpu.max").write_text(f"{int(value * period)} {period}")
                    else:
                        (folder / "cpu.cfs_period_us").write_text(str(period))
                        (folder / "cpu.cfs_quota_us").write_text(str(int(value * period)))
        except OSError:
            self.close()
            raise
        self._procs = [str(f / "cgroup.procs").encode() for f in self.folders]

    def join(self) -> None:
        """In the child, before it execs: move it into the groups."""
        pid = str(os.getpid()).encode()
        for procs in self._procs:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def peak_processes(self) -> int | None:
        for folder in self.folders:
            try:
                return int((folder / "pids.peak").read_text())
            except (OSError, ValueError):
                continue
        return None

    def close(self) -> None:
        """Remove the groups (their processes are gone with the PID namespace; a straggler is waited for)."""
        for folder in self.folders:
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    try:
                        for pid in (folder / "cgroup.procs").read_text().split():
                            try:
                                os.kill(int(pid), 9)
                            except OSError:
                                pass
                    except OSError:
                        pass
                    time.sleep(0.02)
        self.folders = []
