"""What the PostgreSQL benchmarks share: a throwaway cluster (``tests/pg_cluster.py``) that commits as a
production server does, and CPU accounting from /proc (a process tree, the whole machine).

The cluster lives under ``.cache/`` (as root the server runs as the postgres user, who cannot enter
private temporary folders) and is destroyed on exit. Its CPU is the postmaster's and every backend's,
including backends that ended during the measurement (their time is added to the postmaster's
``cutime``/``cstime`` when it reaps them).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_TICK = os.sysconf("SC_CLK_TCK")


def start_cluster(name: str = "bench-pg"):
    """A new PostgreSQL cluster with fsync and full-page writes on (the tests' cluster has them off), loopback
    only, destroyed when this process exits."""
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.pg_cluster import PostgresCluster

    cluster = PostgresCluster(ROOT / ".cache" / f"{name}-{os.getpid()}", durable=True).start()
    atexit.register(cluster.destroy)
    return cluster


def postmaster_pid(cluster) -> int:
    return int((cluster.data / "postmaster.pid").read_text().split()[0])


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_cpu(pid: int, *, reaped: bool = True) -> float:
    """CPU seconds (user + system) of one process, with those of its children that ended and were reaped."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    n = 15 if reaped else 13
    return sum(int(x) for x in fields[11:n]) / _TICK


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*") if Path(f"/proc/{pid}/task").exists() else []:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return found


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid`` and each process below it, by pid (each with its reaped children)."""
    out = {pid: process_cpu(pid)}
    for child in children(pid):
        out.update(tree_cpu(child))
    return out


def cluster_cpu(cluster) -> float:
    """CPU seconds of the whole cluster so far (the postmaster, its live and its ended backends)."""
    return sum(tree_cpu(postmaster_pid(cluster)).values())


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, over every core (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return (total - idle) / _TICK, total / _TICK
