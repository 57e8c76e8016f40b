"""Start and stop a local vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``).

vLLM lives in its own environment (its transformers range conflicts with verl's), so the server is
a subprocess of an interpreter that can import it, found in this order: the current interpreter,
``LIGHTNING_RL_VLLM_PYTHON``, then ``.venv-vllm/bin/python`` of the working directory or of the
repository this package was imported from (a development checkout). Where none is found, the error
lists what was tried.
Used by the demo, the tests and (later) the local trainer; LoRA hot-loading is enabled on request.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigurationError, EngineStartError
from .settings import ENV_STORE, ENV_VLLM_PYTHON, examples_endpoint, vllm_python


def candidate_pythons() -> list[tuple[Path, str]]:
    """Where a vLLM interpreter is looked for, in order, each with why it is a candidate."""
    import importlib.util
    import sys

    found: list[tuple[Path, str]] = []
    if importlib.util.find_spec("vllm") is not None:
        found.append((Path(sys.executable), "this interpreter, which can import vllm"))
    env = vllm_python()
    if env:
        found.append((Path(env), f"${ENV_VLLM_PYTHON}"))
    found.append((Path.cwd() / ".venv-vllm" / "bin" / "python", "the working directory's .venv-vllm"))
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():  # a source checkout (not an installed wheel's site-packages)
        found.append((checkout / ".venv-vllm" / "bin" / "python", "the checkout's .venv-vllm (make venv-vllm)"))
    return found


def default_python() -> Path:
    """The first candidate that exists (else the last one, which ``start`` reports with the others)."""
    candidates = candidate_pythons()
    for path, _ in candidates:
        if path.exists():
            return path
    return candidates[-1][0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    """A running vLLM OpenAI server. ``base_url`` ends in ``/v1``. Use as a context manager."""

    model: str
    served_name: str = "tiny"
    port: int = field(default_factory=free_port)
    python: Path = field(default_factory=default_python)
    max_model_len: int = 2048
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1  # adapters in one batch (one per policy a team trains)
    # VLLM_SERVER_DEV_MODE=1: the routes a full-weights publish uses (/pause, /collective_rpc, /resume; vllm_full)
    dev_mode: bool = False
    # the KV cache's memory, MiB (--kv-cache-memory-bytes; the CPU build allocates and touches all of it at start).
    # None: $VLLM_CPU_KVCACHE_SPACE GiB, else 1 GiB. The tiny model holds a token in 2 KiB: 256 MiB is 131,072 tokens
    kv_cache_mib: int | None = None
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    ready_timeout: float = 300.0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def command(self) -> list[str]:
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--served-model-name", self.served_name, "--dtype", "float32",
            "--max-model-len", str(self.max_model_len), "--enforce-eager", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            # log-probs after temperature (and any top-k/top-p), the distribution the tokens were sampled
            # from: what the trainer computes, so the two mean the same thing (the behaviour policy)
            "--logprobs-mode", "processed_logprobs",
            # JSON constrained by a schema (response_format json_schema) is written compact: the grammar
            # otherwise lets a small model spend max_tokens on spaces between fields (the tiny model did,
            # greedy). A named tool_choice's structural tag is not covered by this vLLM option.
            "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
            # a seeded request whose prefill is split across engine steps crashes vLLM-CPU 0.32's engine
            # (its CPU generator cannot rewind: "CPU Generator does not use offset"); many agents at once
            # split prefills, so prompts are prefilled whole
            "--no-enable-chunked-prefill",
        ]
        if self.enable_lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        if self.kv_cache_mib is not None:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_mib * 2**20)]
        return cmd + list(self.extra_args)

    def start(self) -> "VLLMServer":
        if not self.python.exists():
            tried = "; ".join(f"{path} ({why})" for path, why in candidate_pythons())
            raise ConfigurationError(
                f"no vLLM interpreter at {self.python}. Tried: {tried}. Install vllm into this environment, set "
                f"{ENV_VLLM_PYTHON} to a Python that can import it, or run `make venv-vllm` in the repository"
            )
        kv = self.kv_cache_mib
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ConfigurationError(f"kv_cache_mib must be a whole number of MiB, at least 1 (or None: "
                                     f"$VLLM_CPU_KVCACHE_SPACE GiB, else 1 GiB), got {self.kv_cache_mib!r}")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if self.kv_cache_mib is not None:  # the CPU build lets $VLLM_CPU_KVCACHE_SPACE override the option
            env.pop("VLLM_CPU_KVCACHE_SPACE")
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop(ENV_STORE, None)
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()
        return self

    def _tail(self) -> str:
        if self.log_path and Path(self.log_path).exists():
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        return "(no log; pass log_path to see the server's output)"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineStartError(
                    f"the vLLM server for {self.model!r} exited with code {self.process.returncode} before it was "
                    f"ready; fix what its log below names (model path, port, memory) and start it again:\n"
                    f"{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineStartError(
            f"the vLLM server for {self.model!r} was not ready after ready_timeout={self.ready_timeout}s (stopped); "
            f"give it longer (ready_timeout=) or read its log below for what held it:\n{self._tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_or_connect(model_dir: str | None = None, *, log_path: Path | None = None) -> Iterator[tuple[str, str, str]]:
    """``(base_url, model, api_key)`` for examples and demos: ``LIGHTNING_RL_BASE_URL`` (with
    ``LIGHTNING_RL_MODEL`` and ``LIGHTNING_RL_API_KEY``) when set, else the project's tiny model
    served by a local vLLM for the duration of the block (built with ``make model`` if missing)."""
    endpoint = examples_endpoint()
    if endpoint is not None:
        yield endpoint
        return
    root = Path(__file__).resolve().parent.parent
    model = Path(model_dir) if model_dir else root / ".cache" / "tiny-qwen2"
    if not (model / "config.json").exists():
        subprocess.run(["make", "-C", str(root), "model"], check=True)
    with VLLMServer(model=str(model), log_path=log_path) as server:
        yield server.base_url, server.served_name, "EMPTY"
