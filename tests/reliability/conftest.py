"""Processes for the reliability suite: a store server and runners, started as the CLI starts them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ..services import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / ".cache" / "reliability"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``lightning-rl store serve`` on a fixed port, so that it can be killed and started again."""

    def __init__(self, db: Path, port: int, workers: int = 1) -> None:
        self.db, self.port, self.workers = db, port, workers
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db", str(self.db), "--port",
             str(self.port), "--workers", str(self.workers)],
            stderr=subprocess.DEVNULL, start_new_session=True)
        wait_healthy(self.url, self.proc, what="the store server")
        return self

    def kill(self) -> None:
        """SIGKILL the server and its workers (a crash, not a shutdown)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)


@pytest.fixture
def spill_env(tmp_path):
    """An environment whose spill directory belongs to this test alone."""
    return dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path / "spill"), PYTHONPATH=str(ROOT))


@pytest.fixture
def server_factory(tmp_path):
    servers: list[ServerProcess] = []

    def make(workers: int = 1) -> ServerProcess:
        server = ServerProcess(tmp_path / "served.db", free_port(), workers)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


def start_runner(url: str, env: dict, report: Path, *, agent: str = "tests.store.server_agents:steps",
                 concurrency: int = 4, lease_seconds: float = 30.0, idle_exit: float = 3.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_rl.cli", "runner", "--agent", agent, "--store", url,
         "--concurrency", str(concurrency), "--lease-seconds", str(lease_seconds), "--idle-exit", str(idle_exit),
         "--report", str(report)],
        env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)


def write_figures(name: str, figures: dict) -> None:
    """Figures for docs/reliability.md, one JSON file per test."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.json").write_text(json.dumps(figures, indent=2))
    print(f"\n{name}: {json.dumps(figures)}")
