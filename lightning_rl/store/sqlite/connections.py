"""SQLite connections of a store: WAL, a busy timeout, durability, read-only opens, and where the file lives.

``connect`` opens a file as a lightning-rl store (foreign files and newer schemas are refused before
anything is written); ``filesystem_type`` tells when a store sits on a network filesystem, where
SQLite's locks and WAL do not hold across machines.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ...errors import StoreError
from ...settings import check_synchronous
from .migrations import check_is_store


# Filesystem types on which SQLite's locking and WAL (shared memory) do not hold across machines.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "lustre", "gpfs", "beegfs", "glusterfs",
    "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "fuse.cephfs",
})
MOUNTS = Path("/proc/mounts")


def filesystem_type(path: str | os.PathLike[str], mounts: Path | None = None) -> str | None:
    """The type of the filesystem that holds ``path`` (the longest mount point above it), if known."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        lines = (mounts or MOUNTS).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def connect(path: str, busy_timeout: float = 30.0, synchronous: str = "normal",
            read_only: bool = False) -> sqlite3.Connection:
    """Open ``path`` as a lightning-rl store connection (refusing foreign files), WAL mode.

    ``synchronous="normal"`` (the default): a commit survives the process being killed, not an OS
    crash or a power loss; ``"full"``: it survives those too, for an fsync per commit.
    ``read_only``: an existing file only, and no statement of this connection can write (``query_only``)."""
    if read_only:
        uri = "file:" + Path(path).resolve().as_posix().replace("?", "%3f").replace("#", "%23") + "?mode=rw"
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        except sqlite3.OperationalError as exc:
            raise StoreError(f"cannot open {path!r} read-only ({exc}); give the path of an existing store") from None
        try:
            conn.execute("PRAGMA query_only = ON")
            check_is_store(conn, path)
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        except BaseException:
            conn.close()
            raise
        return conn
    conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
    try:
        check_is_store(conn, path)
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {check_synchronous(synchronous).upper()}")
        # Freed cells are zeroed where that costs no extra I/O (an updated row's old copy included), so an
        # erasure (``erasure.py``, which deletes with secure_delete ON) leaves no older copy of the text behind.
        conn.execute("PRAGMA secure_delete = FAST")
    except BaseException:
        conn.close()
        raise
    return conn
