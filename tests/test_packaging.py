"""The package installs whole (issue 31): the wheel, built from this checkout, installed with each extra
into a fresh virtual environment outside the repository, runs what that extra is for; without an extra,
its commands end with one line naming ``pip install 'lightning-rl[extra]'``. And every module the package
imports is declared, in the core or in the extra ``errors.EXTRA_OF_MODULE`` names for it.

Not installed here: ``verl`` (its own environment, ``.venv-verl``: it pins transformers below LangChain's)
and ``vllm`` (a CUDA build; the CPU build lives in ``.venv-vllm``)."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from lightning_rl.errors import EXTRA_OF_MODULE

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# distribution (as pyproject names it) -> the top-level modules it provides
PROVIDES = {
    "opentelemetry-api": {"opentelemetry"}, "opentelemetry-sdk": {"opentelemetry"}, "pydantic": {"pydantic"},
    "sqlite-utils": {"sqlite_utils"}, "click": {"click"}, "openai": {"openai"}, "orjson": {"orjson"},
    "httpx": {"httpx"}, "typing-extensions": {"typing_extensions"},
    "fastapi": {"fastapi", "starlette"}, "uvicorn": {"uvicorn"}, "httptools": {"httptools"}, "anyio": {"anyio"},
    "opentelemetry-proto": {"opentelemetry", "google"},
    "torch": {"torch"}, "transformers": {"transformers"}, "safetensors": {"safetensors"}, "numpy": {"numpy"},
    "tqdm": {"tqdm"}, "peft": {"peft"}, "matplotlib": {"matplotlib"},
    "verl": {"verl", "ray", "hydra", "omegaconf", "pandas", "tensordict"}, "transferqueue": {"transfer_queue"}, "cachetools": {"cachetools"}, "jsonschema": {"jsonschema"}, "pyarrow": {"pyarrow"},
    "tensorboard": {"tensorboard"}, "mlflow-skinny": {"mlflow"}, "wandb": {"wandb"},
    "langchain": {"langchain"}, "langchain-openai": {"langchain_openai"}, "langgraph": {"langgraph"},
    "autogen-agentchat": {"autogen_agentchat", "autogen_core"}, "autogen-ext": {"autogen_ext"}, "vllm": {"vllm"},
    "psycopg": {"psycopg"}, "psycopg-pool": {"psycopg_pool"},
    "google-adk": {"google"}, "litellm": {"litellm"},
}
# modules the package imports only when their library is already loaded by the user's program
# (the HTTP-layer hooks: adapters/http_clients.py), so no extra installs them
USERS_OWN = {"requests", "aiohttp", "yarl", "httpx2", "langchain_core",
             # the agent frameworks instrumented on import (adapters/__init__.py's post-import hook)
             "agents", "pydantic_ai", "smolagents", "crewai", "llama_index", "mcp"}


def _name(requirement: str) -> str:
    for stop in "<>=[;! ":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower()


def _provided(requirements: list[str]) -> set[str]:
    found: set[str] = set()
    for req in requirements:
        found |= PROVIDES[_name(req)]
    return found


def _imports() -> dict[str, set[str]]:
    std = set(sys.stdlib_module_names) | {"__future__"}
    found: dict[str, set[str]] = {}
    for path in (ROOT / "lightning_rl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in std and top != "lightning_rl":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_is_declared_where_the_error_says():
    core = _provided(PYPROJECT["project"]["dependencies"])
    extras = {name: _provided(reqs) for name, reqs in PYPROJECT["project"]["optional-dependencies"].items()
              if name != "dev"}  # dev: the test tools
    for module, files in _imports().items():
        if module in core or module in USERS_OWN:
            continue
        extra = EXTRA_OF_MODULE.get(module)
        assert extra is not None, f"{module} (imported by {sorted(files)}) is in no extra's error table"
        assert module in extras[extra], f"{module} is said to come with [{extra}], which does not declare it"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, timeout=600)
    (built,) = out.glob("lightning_rl-*.whl")
    return built


def _venv(where: Path, wheel: Path, extras: str = "", first: tuple[str, ...] = ()) -> Path:
    """A fresh virtual environment outside the repository with the wheel (and ``extras``) installed."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # --no-compile: Python compiles what a command imports when it runs; compiling every installed module first
    # (torch, transformers, wandb, ...) was 30% of its CPU time (181 s; 128 s without, 2026-11-28)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
           "-c", str(ROOT / "constraints.txt")]
    if first:  # torch first, as the README says (the CPU build on this machine)
        subprocess.run([*pip, *first], check=True, capture_output=True, timeout=1200)
    done = subprocess.run([*pip, f"{wheel}{extras}"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv / "bin"


#: The environments, each fresh: the core alone (which runs the servers too), and the extras.
INSTALLS = {"core": ("", ()), "rewards,data,postgres": ("[rewards,data,postgres]", ()),
            "local,trackers": ("[local,trackers]", ("torch==2.13.0",)), "langchain": ("[langchain]", ()),
            "autogen": ("[autogen]", ())}


@pytest.fixture(scope="module")
def venvs(tmp_path_factory, wheel) -> dict[str, Path]:
    """Every install of ``INSTALLS``, three at a time (pip is mostly waiting on the disk and the index)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(_venv, tmp_path_factory.mktemp(name.replace(",", "-")), wheel, extras, first)
                   for name, (extras, first) in INSTALLS.items()}
        return {name: future.result() for name, future in futures.items()}


def _run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIGHTNING_RL_STORE")})


pytestmark = pytest.mark.slow


def test_the_core_install_talks_to_a_store_server_and_says_which_extra_the_rest_needs(tmp_path, venvs):
    bin_dir = venvs["core"]
    probe = _run(bin_dir, "python", "-c", "import lightning_rl as lrl; s = lrl.open_store('http://127.0.0.1:1'); "
                                          "print(type(s).__name__); s.close()", cwd=tmp_path)
    assert probe.returncode == 0 and probe.stdout.strip() == "HttpStore", probe.stderr[-2000:]  # before: no httpx
    for command, extra in ((("train", "continuous", "--model-dir", "m", "--server-url", "http://127.0.0.1:1",
                             "--store", "x.db"), "local"),
                           (("rollouts", "ls", "--store", "postgresql://lrl@127.0.0.1:1/runs"), "postgres")):
        out = _run(bin_dir, "lightning-rl", *command, cwd=tmp_path)
        assert out.returncode == 1 and "Traceback" not in out.stderr, (command, out.stderr[-2000:])
        assert f"pip install 'lightning-rl[{extra}]'" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def _up(url: str, proc: subprocess.Popen) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def test_the_core_install_starts_the_store_server_the_gateway_and_the_viewer(tmp_path, venvs):
    """Issue 32: the gateway starts from a plain install (before: `pip install 'lightning-rl[server]'`)."""
    bin_dir = venvs["core"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIGHTNING_RL_STORE")}
    ports = [_free_port() for _ in range(3)]
    commands = [
        ([str(bin_dir / "lightning-rl"), "store", "serve", "--db", "served.db", "--port", str(ports[0])],
         f"http://127.0.0.1:{ports[0]}/v1/health"),
        ([str(bin_dir / "lightning-rl"), "gateway", "--upstream", "http://127.0.0.1:9", "--store", "gw.db",
          "--port", str(ports[1])], f"http://127.0.0.1:{ports[1]}/v1/health"),
        ([str(bin_dir / "lightning-rl"), "view", "--store", "served.db", "--port", str(ports[2])],
         f"http://127.0.0.1:{ports[2]}/health"),
    ]
    procs = []
    try:
        for argv, health in commands:
            proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
            procs.append(proc)
            assert _up(health, proc), (argv, proc.stderr.read()[-3000:] if proc.poll() is not None else "not up")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


@pytest.mark.parametrize("install, probe", [
    ("rewards,data,postgres", "from lightning_rl import rewards; import lightning_rl.store.parquet; "
                              "import lightning_rl.store.postgres.store as p; p._psycopg(); "
                              "print(float(rewards.json_schema('{\"a\": 1}', {'type': 'object', 'required': ['a']})))"),
    ("local,trackers", "import lightning_rl.trainer_bridge.local, lightning_rl.trainer_bridge.loggers as l; "
                       "import torch.utils.tensorboard, mlflow, wandb; print('ok')"),
    ("langchain", "import langchain_core, lightning_rl.adapters.langchain as a; print(a.instrument())"),
    ("autogen", "import autogen_agentchat, lightning_rl.adapters.autogen as a; print(a.instrument())"),
])
def test_each_extra_installs_what_its_modules_import(tmp_path, venvs, install, probe):
    out = _run(venvs[install], "python", "-c", probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
