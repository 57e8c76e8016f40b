"""Snapshots and the copy-on-write views tries get of them (overlayfs).

A :class:`Snapshot` is a task's environment prepared once: its folder copied (refused past a stated size), then its
setup command run there in a sandbox (installing its dependencies, say). A try's sandbox sees the snapshot through
an overlay: the snapshot is the lower layer, read-only; what the try writes goes to an upper folder of its own. The
overlay is mounted in the mount namespace of each command's run (and goes with it: no mount is ever left on the
host), unprivileged where user namespaces are on (``userxattr``, Linux >= 5.11). Reset is emptying the upper folder;
restoring a protected path is removing the try's layer over it.

Between runs the layers are read and written here, on the host, as overlayfs defines them: a deleted file is a
whiteout (a character device 0/0) in the upper folder, a folder the try replaced is "opaque" (an extended
attribute), and everything else not in the upper folder is the snapshot's.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import ConfigurationError, SandboxError

_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
#: what a task folder may hold by default when a snapshot is made (``Snapshot(max_files=, max_mb=)``)
MAX_FILES, MAX_MB = 100_000, 2048


# Resolved here, in the parent, once: a child between fork and exec must not dlopen or dlsym (the loader's lock may
# be held by another thread of the parent at the fork, and then the child waits on it forever: seen as a sandbox
# command that never started, its Popen waiting for the exec, when the suite ran under load).
_LIBC = ctypes.CDLL(None, use_errno=True)
_UNSHARE, _MOUNT = _LIBC.unshare, _LIBC.mount




def overlay_options(lower: Path, upper: Path, work: Path, privileged: bool) -> bytes:
    for path in (lower, upper, work):
        if any(c in str(path) for c in ",:\\"):
            raise ConfigurationError(f"{str(path)!r} holds ',', ':' or '\\', which overlayfs options cannot carry; "
                                     "give sandboxes a root folder without them (TMPDIR)")
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    return (options if privileged else options + ",userxattr").encode()


def mount_overlay_in_child(options: bytes, merged: Path) -> None:
    """Run in the command's child before it execs bwrap: a mount namespace of its own (and, unprivileged, a user
    namespace mapping only this user), then the overlay at ``merged``. A failure is written to stderr with
    exit status 125, before anything of the try starts."""
    uid, gid = os.getuid(), os.getgid()
    step = "unshare"
    try:
        # A new user namespace is refused (EINVAL) while anything else holds a reference to this process's memory:
        # right after fork, a reader of /proc/PID (ps, a process scan) can; measured here in 62 of 200 forks of a
        # process with threads. The reference is brief: retried.
        for attempt in range(200):
            if _UNSHARE(_CLONE_NEWNS if uid == 0 else _CLONE_NEWNS | _CLONE_NEWUSER) == 0:
                break
            if ctypes.get_errno() != errno.EINVAL or attempt == 199:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            time.sleep(0.001)
        if uid != 0:
            step = "map this user"
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        step = "make mounts private"
        if _MOUNT(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        step = "mount the overlay"
        if _MOUNT(b"overlay", str(merged).encode(), b"overlay", 0, options) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except OSError as exc:
        os.write(2, f"lightning-rl sandbox: could not {step} for the try's copy-on-write view: {exc}\n".encode())
        os._exit(125)


def _is_whiteout(path: Path) -> bool:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque_xattr(privileged: bool) -> str:
    return "trusted.overlay.opaque" if privileged else "user.overlay.opaque"


def _is_opaque(path: Path, privileged: bool) -> bool:
    try:
        return os.getxattr(path, _opaque_xattr(privileged), follow_symlinks=False) == b"y"
    except OSError:
        return False


def relative_parts(path: str) -> tuple[str, ...]:
    """``path`` inside a sandbox's folder as its parts; refused when it would leave the folder."""
    pure = PurePosixPath(path)
    parts = tuple(p for p in (pure.parts[1:] if pure.is_absolute() else pure.parts) if p not in ("", "."))
    if pure.is_absolute() or ".." in parts or not parts:
        raise ConfigurationError(f"{path!r} leaves the sandbox's folder; give a path inside it")
    return parts


class Layers:
    """A try's view of a snapshot (``lower``) with its own writes (``upper``), read and written on the host between
    runs as the overlay would show them."""

    def __init__(self, lower: Path, upper: Path, privileged: bool) -> None:
        self.lower, self.upper, self.privileged = lower, upper, privileged

    def seen(self, path: str) -> Path:
        """The host path of what the try sees at ``path``; FileNotFoundError when it sees nothing there. A symlink on
        the way is refused (it would be followed on the host)."""
        parts = relative_parts(path)
        upper, lower_shows = self.upper, True
        for n, part in enumerate(parts):
            upper = upper / part
            if not os.path.lexists(upper):
                break
            if _is_whiteout(upper):
                raise FileNotFoundError(errno.ENOENT, "deleted by the try", path)
            self._no_link(upper, path)
            if n == len(parts) - 1:
                return upper
            if not upper.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a folder in the sandbox", path)
            lower_shows = lower_shows and not _is_opaque(upper, self.privileged)
        lower = self.lower.joinpath(*parts)
        for n in range(1, len(parts) + 1):
            self._no_link(self.lower.joinpath(*parts[:n]), path)
        if not lower_shows or not os.path.lexists(lower):
            raise FileNotFoundError(errno.ENOENT, "not in the sandbox", path)
        return lower

    @staticmethod
    def _no_link(host: Path, path: str) -> None:
        if host.is_symlink():
            raise ConfigurationError(f"{path!r} goes through a symlink in the sandbox; read it from inside "
                                     "(run(['cat', ...])), where the link means what the try meant")

    def writable(self, path: str) -> Path:
        """The host path in the upper folder to write ``path`` to, its folders made as the overlay would see them
        (a folder the try deleted comes back empty, not with the snapshot's files)."""
        parts = relative_parts(path)
        folder = self.upper
        for n, part in enumerate(parts[:-1]):
            folder = folder / part
            if _is_whiteout(folder):
                folder.unlink()
                folder.mkdir()
                os.setxattr(folder, _opaque_xattr(self.privileged), b"y", follow_symlinks=False)
            elif not os.path.lexists(folder):
                try:
                    seen = self.seen("/".join(parts[: n + 1]))
                except FileNotFoundError:
                    seen = None
                if seen is not None and not seen.is_dir():
                    raise ConfigurationError(f"{'/'.join(parts[: n + 1])!r} is a file in the sandbox; {path!r} "
                                             "cannot go under it")
                folder.mkdir()
            else:
                self._no_link(folder, path)
        target = folder / parts[-1]
        if _is_whiteout(target) or target.is_symlink():
            target.unlink()
        return target

    def listdir(self, path: str) -> list[str]:
        """The names the try sees in a folder."""
        parts = relative_parts(path) if path not in ("", ".") else ()
        upper = self.upper.joinpath(*parts)
        lower_shows = True
        if parts:
            shown = self.seen(path)
            if not shown.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a folder in the sandbox", path)
            lower_shows = shown != upper or not _is_opaque(upper, self.privileged)
            for n in range(1, len(parts)):  # a folder above replaced by the try hides the snapshot's below it
                lower_shows = lower_shows and not _is_opaque(self.upper.joinpath(*parts[:n]), self.privileged)
        names = set()
        lower = self.lower.joinpath(*parts)
        if lower_shows and lower.is_dir() and not lower.is_symlink():
            names.update(os.listdir(lower))
        if upper.is_dir() and not upper.is_symlink():
            for name in os.listdir(upper):
                (names.discard if _is_whiteout(upper / name) else names.add)(name)
        return sorted(names)

    def export(self, path: str, target: Path) -> None:
        """Copy what the try sees under ``path`` (a folder) to ``target`` on the host."""
        target.mkdir(parents=True)
        for name in self.listdir(path):
            inner = name if path in ("", ".") else f"{path}/{name}"
            parts = relative_parts(inner)
            upper, lower = self.upper.joinpath(*parts), self.lower.joinpath(*parts)
            host = upper if os.path.lexists(upper) else lower
            if host.is_symlink():
                os.symlink(os.readlink(host), target / name)
            elif host.is_dir():
                self.export(inner, target / name)
            else:
                shutil.copy2(host, target / name)

    def restore(self, paths: Sequence[str]) -> list[str]:
        """Put back the snapshot's version of each path (a file or a folder): the try's layer over it is removed,
        and where a folder above it was deleted or replaced by the try, the snapshot's copy is put there. Returns the
        paths that the try had changed."""
        changed = []
        for path in paths:
            parts = relative_parts(path)
            upper, lower = self.upper.joinpath(*parts), self.lower.joinpath(*parts)
            touched = os.path.lexists(upper)
            if touched:
                shutil.rmtree(upper) if upper.is_dir() and not upper.is_symlink() else upper.unlink()
            try:
                shown = self.seen(path)
            except (FileNotFoundError, NotADirectoryError):
                shown = None
            if os.path.lexists(lower) and shown != lower:  # hidden by a folder above it the try deleted or replaced
                touched = True
                target = self.writable(path)
                if lower.is_dir() and not lower.is_symlink():
                    shutil.copytree(lower, target, symlinks=True)
                else:
                    shutil.copy2(lower, target, follow_symlinks=False)
            if touched:
                changed.append(path)
        return changed

    def reset(self, work: Path) -> None:
        """Forget every write of the try: the next run sees the snapshot as it was made."""
        for folder in (self.upper, work):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()


def disk_usage(folder: Path) -> int:
    """Bytes on disk under ``folder`` (a try's writes: its upper folder, or its copy)."""
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_blocks * 512
            except OSError:
                pass
    return total


def folder_size(source: Path, max_files: int, max_mb: int) -> tuple[int, int]:
    """(files, bytes) under ``source``; refused with the fix when it cannot be read or is over the limits."""
    files = size = 0
    if not source.is_dir() or not os.access(source, os.R_OK | os.X_OK):
        raise ConfigurationError(f"sandbox folder {str(source)!r} is not a readable folder; give the task's folder")

    def refuse(exc: OSError) -> None:
        raise ConfigurationError(f"the task folder {str(source)!r} cannot be read ({exc}); make it readable or "
                                 "leave that path out of it")

    for folder, dirs, names in os.walk(source, onerror=refuse):
        for name in names:
            files += 1
            try:
                size += os.lstat(os.path.join(folder, name)).st_size
            except OSError as exc:
                refuse(exc)
        if files > max_files or size > max_mb << 20:
            raise ConfigurationError(
                f"the task folder {str(source)!r} holds more than {max_files} files or {max_mb} MB; leave out what the "
                "try does not need (build outputs, .venv), or raise Snapshot(max_files=, max_mb=)")
        for name in dirs:
            if not os.access(os.path.join(folder, name), os.R_OK | os.X_OK):
                refuse(PermissionError(errno.EACCES, "cannot be read", os.path.join(folder, name)))
    return files, size


class Snapshot:
    """A task's environment, prepared once: ``source`` copied (refused past ``max_files`` files or ``max_mb`` MB),
    then ``setup`` (argv) run in it in a ``backend`` sandbox within ``setup_timeout`` seconds (with the network when
    ``setup_network``, to install dependencies). Every sandbox opened with ``snapshot=`` starts from it,
    copy-on-write; nothing a try does reaches it. ``close`` removes it (after its sandboxes)."""

    def __init__(self, source: str | os.PathLike[str] | None = None, *, setup: Sequence[str] | None = None,
                 setup_timeout: float = 600.0, setup_network: bool = False, backend: str = "bwrap",
                 max_files: int = MAX_FILES, max_mb: int = MAX_MB, limits: Any = None) -> None:
        began = time.monotonic()
        self.files, self.bytes = folder_size(Path(source), max_files, max_mb) if source is not None else (0, 0)
        self.root = Path(tempfile.mkdtemp(prefix="lrl-snapshot-"))
        self.path = self.root / "fs"
        self.backend = backend
        try:
            if source is None:
                self.path.mkdir()
            else:
                shutil.copytree(source, self.path, symlinks=True)
            self.setup_result = None
            if setup:
                from .backends import open_sandbox

                with open_sandbox(backend, in_place=self.path, limits=limits, network=setup_network) as box:
                    done = box.run(list(setup), timeout=setup_timeout)
                if not done.ok:
                    why = {"deadline": f"ran past its deadline of {setup_timeout:g} s"}.get(
                        done.ended, f"ended ({done.ended}, exit code {done.exit_code})")
                    raise SandboxError(f"the snapshot's setup {list(setup)!r} {why}: "
                                       f"{(done.stderr or done.stdout).strip()[-1000:] or '(no output)'}")
                self.setup_result = done
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self.seconds = time.monotonic() - began
        self.closed = False

    def close(self) -> None:
        self.closed = True
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
