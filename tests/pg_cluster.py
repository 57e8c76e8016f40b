"""A throwaway PostgreSQL cluster for the tests and benchmarks: Debian's server binaries, a data folder of
its own (under ``.cache/`` or a temporary folder), loopback only, started and stopped like the vLLM server.

``make postgres`` installs Debian's ``postgresql`` when its binaries are missing. As root (CI), the server
runs as the ``postgres`` user, as initdb requires.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path


def server_binaries() -> Path | None:
    """The folder with initdb and pg_ctl: Debian's newest ``/usr/lib/postgresql/<v>/bin``, else PATH's."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """``start()`` makes and starts a cluster in ``root`` (a new folder); ``url(db)`` connects to a database
    of it (``create_database`` makes one); ``stop()``, ``kill()`` (an immediate shutdown: what a crash of the
    server leaves) and ``start()`` again for the reliability tests; ``destroy()`` removes the folder.
    ``durable=True`` keeps PostgreSQL's own defaults of fsync and full-page writes (a commit is on disk when
    it returns, as in production: the benchmarks); the tests turn them off."""

    def __init__(self, root: Path, *, port: int | None = None, durable: bool = False) -> None:
        binaries = server_binaries()
        if binaries is None:
            raise RuntimeError("PostgreSQL's server binaries are not installed; run `make postgres` (Debian's "
                               "postgresql package)")
        self.bin = binaries
        self.root = Path(root).resolve()
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log = self.root / "server.log"
        self.port = port or _free_port()
        self.durable = durable
        self._as_postgres = os.geteuid() == 0
        self.user = "postgres" if self._as_postgres else getpass.getuser()

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def start(self) -> "PostgresCluster":
        if not self.data.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            self.sockets.mkdir(exist_ok=True)
            if self._as_postgres:
                shutil.chown(self.root, "postgres", "postgres")
                shutil.chown(self.sockets, "postgres", "postgres")
            self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8",
                      "--locale=C", "--no-sync")
        options = (f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 "
                   f"{'' if self.durable else '-c fsync=off -c full_page_writes=off '}"
                   "-c max_connections=200 -c shared_buffers=128MB")
        result = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60",
                           "start", check=False)
        if result.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"PostgreSQL did not start: {result.stderr.strip()}\n{tail}")
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new, empty database; returns its URL."""
        name = name or f"lrl_{uuid.uuid4().hex[:12]}"
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name)
        return self.url(name)

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)

    def kill(self) -> None:
        """Stop the server at once, as a crash would (no checkpoint; the next start recovers from the WAL)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def destroy(self) -> None:
        if self.data.exists():
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"PostgreSQL on port {self.port} did not come back in {timeout:g} s")
