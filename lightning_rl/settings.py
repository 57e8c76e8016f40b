"""Settings read from ``LIGHTNING_RL_*`` environment variables. Each variable is documented once, here.

=================================  ==========================================================  =====================
variable                           meaning                                                     default
=================================  ==========================================================  =====================
``LIGHTNING_RL_STORE``             where rollouts go: ``sqlite:///path.db``, a plain path,      ``sqlite:///lightning_rl.db``
                                   ``memory://``, ``http://host:port`` of a store server (several,
                                   comma-separated: a client fails over), or
                                   ``postgresql://user@host:port/db[?schema=NAME]``
``LIGHTNING_RL_STORE_TOKEN``       bearer token for a store server (client and                 none
                                   ``lightning-rl store serve``, where it is the admin token)
``LIGHTNING_RL_STORE_TOKENS_FILE`` ``lightning-rl store serve``'s tokens with roles: lines of   none
                                   ``ROLES TOKEN`` (``store/server_auth.py``), re-read when
                                   the file changes
``LIGHTNING_RL_SPILL_DIR``         where an HTTP or PostgreSQL store keeps records while its   ``~/.cache/lightning-rl/
                                   server or database is unreachable (replayed when it         spill/HOST_PORT``
                                   returns); with several servers, their names joined by       (``pg_HOST_PORT_DB_
                                   ``+``                                                       SCHEMA`` for
                                                                                               PostgreSQL)
``LIGHTNING_RL_MODE``              mode recorded on rollouts: ``train``, ``eval`` or ``prod``  ``train``
``LIGHTNING_RL_CAPTURE_TOKEN_IDS`` add ``return_token_ids`` to LLM requests in a rollout       ``1``
``LIGHTNING_RL_CAPTURE_LOGPROBS``  add ``logprobs`` to LLM requests in a rollout               ``1``
``LIGHTNING_RL_NO_INJECT_HOSTS``   hosts whose LLM requests never get ``return_token_ids`` /   none (api.openai.com
                                   ``logprobs`` (comma-separated; providers that refuse them)  is always skipped)
``LIGHTNING_RL_POLICY_VERSION``    policy version of the served model at start-up, until the   ``0``
                                   store has a publish of it
``LIGHTNING_RL_POLICY_REFRESH``    seconds between reads of the store's publishes (the         ``1``
                                   versions LLM calls are stamped with); read in the
                                   background, so a call never waits for the store
``LIGHTNING_RL_QUEUE_SIZE``        bound of the background writer's queue (records); a full    ``8192``
                                   queue blocks the producer (back-pressure), it never drops
``LIGHTNING_RL_FLUSH_TIMEOUT``     seconds a finishing rollout waits for its rows to be on     ``60``
                                   disk before it logs a warning and returns
``LIGHTNING_RL_SQLITE_SYNCHRONOUS`` ``normal``: a committed rollout survives the process being  ``normal``
                                   killed, not a power loss or OS crash; ``full``: it survives
                                   those too (an fsync per commit)
``LIGHTNING_RL_REDACT``            ``module:function`` applied to every text lightning-rl       none (nothing is
                                   stores, before it is stored (``docs/privacy.md``); a bad    redacted)
                                   value fails at ``configure``/start-up
``LIGHTNING_RL_REDACTED_TOKENS``   token ids of an LLM call whose text redaction changed:      ``drop``
                                   ``drop`` (not stored, not trained on) or ``keep`` (stored;
                                   they decode to the original text)
``LIGHTNING_RL_GATEWAY_TOKEN``     bearer token of ``lightning-rl gateway`` (opening rollouts, none
                                   late rewards); required beyond loopback
``LIGHTNING_RL_VIEW_TOKEN``        token of ``lightning-rl view``; required beyond loopback     none
``LIGHTNING_RL_VLLM_PYTHON``       a Python that has vLLM, for ``VLLMServer`` (after this       none
                                   interpreter, before a ``.venv-vllm``)
``LIGHTNING_RL_BASE_URL``          the examples' OpenAI-compatible endpoint (``.../v1``), used  none (the examples
                                   instead of serving the tiny model (``serve_or_connect``)     serve the tiny model)
``LIGHTNING_RL_MODEL``             the model name the examples request from it                 ``tiny``
``LIGHTNING_RL_API_KEY``           the API key the examples send to it                         ``EMPTY``
``LIGHTNING_RL_CLAUDE``            the ``claude`` executable for ``claude_code()`` (when no    none (PATH, then
                                   ``binary=``)                                                ``./node_modules/.bin``)
``LIGHTNING_RL_CODEX``             the ``codex`` executable for ``codex()``, likewise          likewise
``LIGHTNING_RL_OPENCODE``          the ``opencode`` executable for ``opencode()``, likewise    likewise
``LIGHTNING_RL_GATEWAY_URL``       the gateway for ``sandbox exec --network gateway``           none
                                   (``http://HOST:PORT``)
=================================  ==========================================================  =====================

Set by lightning-rl for a command agent (``lightning_rl.command``, the gateway), read by that agent:

=================================  ==========================================================
``LIGHTNING_RL_ROLLOUT_ID``        the id of the rollout the process runs in
``LIGHTNING_RL_TASK``              its task, as JSON (also the first line of its stdin)
``LIGHTNING_RL_REWARDS_URL``       where it may POST rewards for its rollout
``LIGHTNING_RL_MODEL``             the model name to call, when the rollout's caller chose the
                                   engine (``command(upstream=None)``: a verl server)
``LIGHTNING_RL_SANDBOX_WORKDIR``   in a sandbox (``codex()``, ``opencode()``): the try's folder
                                   there (``/work``), used instead of the task's ``cwd``
=================================  ==========================================================

Set by ``train verl`` for verl's processes (``trainer_bridge/verl/main.py``):

=================================  ==========================================================
``LIGHTNING_RL_SECRETS_FILE``      a JSON file (mode 0600) holding ``LIGHTNING_RL_STORE`` and
                                   ``LIGHTNING_RL_STORE_TOKEN``, read when they are not in the
                                   environment (Ray logs every actor's environment)
``LIGHTNING_RL_VERL_VERSION_BASE`` the run's version base: its publishes and call stamps are
                                   base + verl's global step (``trainer_bridge/verl/runs.py``)
=================================  ==========================================================

Read by ``train verl``: ``LIGHTNING_RL_SECRETS_DIR``, where it writes that file (a folder every node mounts, for a
run on several nodes; default: a private temporary folder).

Internal: ``_LIGHTNING_RL_SERVER_ARGS`` carries ``store serve``'s settings to its worker processes.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ConfigurationError

ENV_STORE = "LIGHTNING_RL_STORE"
ENV_MODE = "LIGHTNING_RL_MODE"
ENV_CAPTURE_TOKEN_IDS = "LIGHTNING_RL_CAPTURE_TOKEN_IDS"
ENV_CAPTURE_LOGPROBS = "LIGHTNING_RL_CAPTURE_LOGPROBS"
ENV_POLICY_VERSION = "LIGHTNING_RL_POLICY_VERSION"
ENV_NO_INJECT_HOSTS = "LIGHTNING_RL_NO_INJECT_HOSTS"
ENV_POLICY_REFRESH = "LIGHTNING_RL_POLICY_REFRESH"
ENV_SQLITE_SYNCHRONOUS = "LIGHTNING_RL_SQLITE_SYNCHRONOUS"
SQLITE_SYNCHRONOUS = ("normal", "full")
ENV_QUEUE_SIZE = "LIGHTNING_RL_QUEUE_SIZE"
ENV_FLUSH_TIMEOUT = "LIGHTNING_RL_FLUSH_TIMEOUT"
ENV_STORE_TOKEN = "LIGHTNING_RL_STORE_TOKEN"
ENV_STORE_TOKENS_FILE = "LIGHTNING_RL_STORE_TOKENS_FILE"
#: A JSON file (mode 0600) of secret variables for processes that must not get them in their environment: a
#: launcher writes it (``train verl``: Ray logs every actor's runtime environment, verl prints its config).
ENV_SECRETS_FILE = "LIGHTNING_RL_SECRETS_FILE"
#: Where ``train verl`` writes that file: a folder every node mounts, for a run on several nodes.
ENV_SECRETS_DIR = "LIGHTNING_RL_SECRETS_DIR"
ENV_VERL_VERSION_BASE = "LIGHTNING_RL_VERL_VERSION_BASE"
ENV_SPILL_DIR = "LIGHTNING_RL_SPILL_DIR"
ENV_REDACT = "LIGHTNING_RL_REDACT"
ENV_REDACTED_TOKENS = "LIGHTNING_RL_REDACTED_TOKENS"
REDACTED_TOKENS = ("drop", "keep")
ENV_GATEWAY_TOKEN = "LIGHTNING_RL_GATEWAY_TOKEN"
ENV_VIEW_TOKEN = "LIGHTNING_RL_VIEW_TOKEN"
ENV_VLLM_PYTHON = "LIGHTNING_RL_VLLM_PYTHON"
ENV_BASE_URL = "LIGHTNING_RL_BASE_URL"
ENV_MODEL = "LIGHTNING_RL_MODEL"
ENV_API_KEY = "LIGHTNING_RL_API_KEY"
# set for a command agent by lightning_rl.command
ENV_ROLLOUT_ID = "LIGHTNING_RL_ROLLOUT_ID"
ENV_TASK = "LIGHTNING_RL_TASK"
ENV_REWARDS_URL = "LIGHTNING_RL_REWARDS_URL"
ENV_SANDBOX_WORKDIR = "LIGHTNING_RL_SANDBOX_WORKDIR"
ENV_GATEWAY_URL = "LIGHTNING_RL_GATEWAY_URL"
# the coding-agent CLIs' executables (gateway/coding_agents.py), when not given as binary= nor on PATH
ENV_CLI_BINARY = {"claude": "LIGHTNING_RL_CLAUDE", "codex": "LIGHTNING_RL_CODEX", "opencode": "LIGHTNING_RL_OPENCODE"}
# internal: store serve's settings for its worker processes
ENV_SERVER_WORKER = "_LIGHTNING_RL_SERVER_ARGS"

DEFAULT_STORE = "sqlite:///lightning_rl.db"
MODES = ("train", "eval", "prod")


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{name}={raw!r} is not a boolean; set it to 1 or 0")


def _number(name: str, default: float, kind: type) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not a {kind.__name__}; set it to a number") from None
    if value < 0:
        raise ConfigurationError(f"{name}={raw!r} must not be negative")
    return value


def check_synchronous(value: str, *, what: str = "synchronous") -> str:
    if value.lower() not in SQLITE_SYNCHRONOUS:
        raise ConfigurationError(f"{what}={value!r} is not one of {', '.join(SQLITE_SYNCHRONOUS)}; pick one of those")
    return value.lower()


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigurationError(f"mode {mode!r} is not one of {', '.join(MODES)}; pick one of those")
    return mode


def check_redacted_tokens(value: str, *, what: str = "redacted_tokens") -> str:
    if not isinstance(value, str) or value.lower() not in REDACTED_TOKENS:
        raise ConfigurationError(f"{what}={value!r} is not one of {', '.join(REDACTED_TOKENS)}; pick one of those")
    return value.lower()


def check_redact_spec(spec: str, *, what: str = ENV_REDACT) -> str:
    """``spec`` if it reads ``module:function`` (nothing is imported), else a one-line ConfigurationError."""
    module, sep, name = spec.strip().partition(":")
    if not sep or not module or not name:
        raise ConfigurationError(f"{what}={spec!r} is not module:function; name the redaction function like "
                                 "mypkg.privacy:scrub (a function of one str returning a str)")
    return spec.strip()


def load_redactor(spec: str, *, what: str = ENV_REDACT) -> Callable[[str], str]:
    """The function ``spec`` (``module:function``) names, imported now: a one-line ConfigurationError naming
    the value and the fix when the module cannot be imported or has no such callable."""
    module_name, _, name = check_redact_spec(spec, what=what).partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigurationError(f"{what}={spec!r}: module {module_name!r} cannot be imported "
                                 f"({type(exc).__name__}: {str(exc)[:120]}); put it on PYTHONPATH or fix the "
                                 "module name") from None
    fn: object = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if fn is None:
        raise ConfigurationError(f"{what}={spec!r}: module {module_name!r} has no function {name!r}; name a "
                                 "function of one str that returns a str")
    if not callable(fn):
        raise ConfigurationError(f"{what}={spec!r}: {module_name}.{name} is a {type(fn).__name__}, not a function; "
                                 "name a function of one str that returns a str")
    return fn  # type: ignore[return-value]


@dataclass(slots=True)
class Settings:
    store: str = DEFAULT_STORE
    mode: str = "train"
    capture_token_ids: bool = True
    capture_logprobs: bool = True
    policy_version: int = 0
    policy_refresh: float = 1.0
    queue_size: int = 8192
    flush_timeout: float = 60.0
    no_inject_hosts: frozenset[str] = frozenset()
    sqlite_synchronous: str = "normal"
    #: The redaction function (``configure(redact=...)``), or None. ``redact_spec``: ``module:function`` from
    #: LIGHTNING_RL_REDACT, imported by ``Tracing.redaction`` at configure/start-up.
    redact: Callable[[str], str] | None = None
    redact_spec: str | None = None
    redacted_tokens: str = "drop"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> "Settings":
        return cls(
            store=store_url(),
            mode=check_mode(os.environ.get(ENV_MODE) or "train"),
            capture_token_ids=_flag(ENV_CAPTURE_TOKEN_IDS, True),
            capture_logprobs=_flag(ENV_CAPTURE_LOGPROBS, True),
            policy_version=int(_number(ENV_POLICY_VERSION, 0, int)),
            policy_refresh=float(_number(ENV_POLICY_REFRESH, 1.0, float)),
            queue_size=max(1, int(_number(ENV_QUEUE_SIZE, 8192, int))),
            flush_timeout=float(_number(ENV_FLUSH_TIMEOUT, 60.0, float)),
            no_inject_hosts=frozenset(h.strip() for h in os.environ.get(ENV_NO_INJECT_HOSTS, "").split(",") if h.strip()),
            sqlite_synchronous=check_synchronous(os.environ.get(ENV_SQLITE_SYNCHRONOUS) or "normal",
                                                 what=ENV_SQLITE_SYNCHRONOUS),
            redact_spec=check_redact_spec(os.environ[ENV_REDACT]) if os.environ.get(ENV_REDACT) else None,
            redacted_tokens=check_redacted_tokens(os.environ.get(ENV_REDACTED_TOKENS) or "drop",
                                                  what=ENV_REDACTED_TOKENS),
        )


# One variable at a time, read when called (never cached at import), so that a variable set after import
# (a test's monkeypatch.setenv, a worker process given its settings) is heard. Every read of a
# LIGHTNING_RL_* variable in the package goes through Settings.from_env or one of these
# (tests/test_settings.py holds the package to it); setting one for a child process is done where the child
# is started, by its ENV_ name.


#: The variables a secrets file (``LIGHTNING_RL_SECRETS_FILE``) may hold: a store URL may carry a password.
SECRET_VARIABLES = frozenset({ENV_STORE, ENV_STORE_TOKEN})


def variable(name: str) -> str | None:
    """The value of the variable ``name`` now; None when it is unset or empty. A secret one (``SECRET_VARIABLES``)
    not in the environment is read from ``LIGHTNING_RL_SECRETS_FILE`` when that is set."""
    value = os.environ.get(name) or None
    if value is None and name in SECRET_VARIABLES and os.environ.get(ENV_SECRETS_FILE):
        value = secrets_file(os.environ[ENV_SECRETS_FILE]).get(name) or None
    return value


def secrets_dir() -> str | None:
    """``LIGHTNING_RL_SECRETS_DIR``: where ``train verl`` writes its secrets file (None: a private temporary folder)."""
    return variable(ENV_SECRETS_DIR)


def verl_version_base() -> int:
    """``LIGHTNING_RL_VERL_VERSION_BASE``: the verl run's version base (0 when unset)."""
    return int(_number(ENV_VERL_VERSION_BASE, 0, int))


def secrets_file(path: str) -> dict[str, str]:
    """The secret variables in the JSON file ``path`` (``LIGHTNING_RL_SECRETS_FILE``)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigurationError(
            f"{ENV_SECRETS_FILE}={path} does not exist on this machine; on a run over several nodes give the launcher "
            f"{ENV_SECRETS_DIR}= a folder every node mounts, or export {ENV_STORE} (and {ENV_STORE_TOKEN}) in the "
            "shell that runs `ray start` on each node") from None
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{ENV_SECRETS_FILE}={path} cannot be read ({exc}); it is a JSON object of "
                                 f"{', '.join(sorted(SECRET_VARIABLES))}") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{ENV_SECRETS_FILE}={path} is not a JSON object of variables")
    return {k: str(v) for k, v in data.items() if k in SECRET_VARIABLES}


def store_url() -> str:
    """``LIGHTNING_RL_STORE``, else the default store."""
    return variable(ENV_STORE) or DEFAULT_STORE


def store_token() -> str | None:
    """``LIGHTNING_RL_STORE_TOKEN``: the bearer token a store client sends."""
    return variable(ENV_STORE_TOKEN)


def spill_dir() -> str | None:
    """``LIGHTNING_RL_SPILL_DIR``: where an HTTP or PostgreSQL store spills (None: its own folder under
    ``~/.cache/lightning-rl/spill``)."""
    return variable(ENV_SPILL_DIR)


def vllm_python() -> str | None:
    """``LIGHTNING_RL_VLLM_PYTHON``: a Python that has vLLM."""
    return variable(ENV_VLLM_PYTHON)


def examples_endpoint() -> tuple[str, str, str] | None:
    """``(base_url, model, api_key)`` of ``LIGHTNING_RL_BASE_URL`` (trailing ``/`` removed),
    ``LIGHTNING_RL_MODEL`` and ``LIGHTNING_RL_API_KEY``; None when no base URL is set."""
    base_url = variable(ENV_BASE_URL)
    if base_url is None:
        return None
    return base_url.rstrip("/"), variable(ENV_MODEL) or "tiny", variable(ENV_API_KEY) or "EMPTY"


def server_worker_args() -> dict:
    """The settings ``lightning-rl store serve`` hands its worker processes (``_LIGHTNING_RL_SERVER_ARGS``)."""
    raw = variable(ENV_SERVER_WORKER)
    if raw is None:
        raise ConfigurationError(f"{ENV_SERVER_WORKER} is not set: this app factory runs only in a worker of "
                                 "`lightning-rl store serve`; start the server with that command")
    return json.loads(raw)
