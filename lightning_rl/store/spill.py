"""Spill files: an ordered local backlog of records that could not be written where they belong.

A store that cannot reach its database (a locked or full disk, a store server that does not answer)
appends the records to a spill file instead of dropping them, and so does everything after them,
in order, until the backlog has been replayed. One process owns its files (the pid is in the name);
the files of processes that are gone are adopted by the next process that opens the same folder.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import orjson

from ..diagnostics import count


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # gone, or not a pid at all
        return False
    except PermissionError:
        return True
    return True


#: A spill file's name: when it was written (ns; this version pads it to 20 digits, a file named by hand or by
#: another version may not), the process that owns it, and whether it was adopted.
_SPILL_NAME = re.compile(r"(\d+)-(\d+)(-adopted)?\.jsonl")


def spill_files_in(folder: Path) -> list[Path]:
    """The spill files waiting in ``folder`` (whoever owns them), oldest first; not the ``rejected-*`` files."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.glob("*.jsonl") if (m := _SPILL_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def rejected_files_in(folder: Path) -> list[Path]:
    """The ``rejected-*`` files in ``folder``: records a server refused, each file with the reason on its first line."""
    return sorted(folder.glob("rejected-*.jsonl")) if folder.is_dir() else []


class SpillFiles:
    """Ordered local backlog of records (one JSON line each), owned by one process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: list[Path] = []
        self.last_failure = 0.0
        #: Held while a file is replayed, and while an erasure rewrites the files (``erasure.py``).
        self.lock = threading.Lock()

    def adopt_orphans(self, *, own: bool = False) -> None:
        """Claim the spill files of processes that are gone (a rename, so only one process gets each);
        with ``own``, also this process's files (nothing else in this process uses the folder). A
        ``rejected-*`` file (records a server refused, kept with the reason) is never adopted or replayed."""
        for path in spill_files_in(self.folder):
            created, pid = _SPILL_NAME.fullmatch(path.name).group(1, 2)
            if int(pid) == os.getpid():
                if own and path not in self.files:
                    self.files.append(path)
                continue
            if _pid_alive(int(pid)):
                continue
            claimed = path.with_name(f"{created}-{os.getpid()}-adopted.jsonl")
            try:
                os.rename(path, claimed)
            except OSError:
                continue  # another process claimed it first
            self.files.append(claimed)
            count("spill_files_adopted")
        self.files.sort()

    def append(self, ops: list[bytes]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"{time.time_ns():020d}-{os.getpid()}.jsonl"
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(b"\n".join(ops) + b"\n")
        os.replace(tmp, target)
        self.files.append(target)
        count("spilled_ops", len(ops))

    def reject(self, ops: list[bytes], reason: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"rejected-{time.time_ns():020d}-{os.getpid()}.jsonl"
        target.write_bytes(orjson.dumps({"reason": reason}) + b"\n" + b"\n".join(ops) + b"\n")
        count("rejected_ops", len(ops))
        return target

    @staticmethod
    def read(path: Path) -> list[bytes]:
        return [line for line in path.read_bytes().splitlines() if line]


# Spill folders of stores open in this process: a store opened on a folder nobody here uses may take
# this process's own leftover files too (a store closed with a backlog, then opened again).
_folders_in_use: set[Path] = set()
_folders_lock = threading.Lock()


def claim_folder(folder: Path) -> bool:
    """Mark ``folder`` used by a store of this process; True if no other store here used it."""
    with _folders_lock:
        first = folder not in _folders_in_use
        _folders_in_use.add(folder)
        return first


def release_folder(folder: Path) -> None:
    with _folders_lock:
        _folders_in_use.discard(folder)


def forget_claims() -> None:
    """In a forked child: the parent's stores are not open in this process (no lock: a thread of the
    parent may have held it when the process forked)."""
    _folders_in_use.clear()
