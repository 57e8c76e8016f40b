"""The coding-agent CLIs as traced agents, through the gateway: Claude Code (``claude -p``), Codex
(``codex exec``) and opencode (``opencode run``), each a ``lrl.command`` with the environment and
configuration that send every LLM call it makes to its rollout's gateway URL."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from .. import semconv
from ..diagnostics import count
from ..errors import ConfigurationError
from ..settings import ENV_CLI_BINARY, ENV_SANDBOX_WORKDIR, variable

# --- Claude Code -------------------------------------------------------------------------------------
# What Claude Code (2.1.332, captured from the real CLI) sends that tells its lines apart: a sub-agent's
# requests (its Agent/Task tool) carry the sub-agent's id in a header; a compaction is a request whose last
# user turn asks for "a detailed summary of the conversation so far"; the requests after one start with
# the summary ("This session is being continued from a previous conversation ...").
CLAUDE_CODE_SUBAGENT_HEADER = "x-claude-code-agent-id"
CLAUDE_CODE_SUBAGENT = "claude-code:subagent"  # the agent name of a sub-agent's calls
CLAUDE_CODE_COMPACTION = "claude-code:compaction"  # and of a compaction's
_COMPACTION_ASK = "create a detailed summary of the conversation so far"
_COMPACTED_START = "This session is being continued from a previous conversation"


def _turn_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or () if isinstance(b, dict) and isinstance(b.get("text"), str))


def claude_code_lineage(headers: Mapping[str, str], body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A Messages request's line in a Claude Code session: ``(agent name or None, span attributes)``.
    A sub-agent's call is agent ``claude-code:subagent`` with the CLI's id of the sub-agent
    (``gen_ai.agent.id``); a compaction's is ``claude-code:compaction``; a call on a compacted context
    keeps its agent and says ``compacted``; each counted (``claude_code_{line}_calls``). Any other
    request: ``(None, {})`` (the main agent's calls, and every other client's)."""
    agent, notes = None, {}
    sub = headers.get(CLAUDE_CODE_SUBAGENT_HEADER)
    if sub:
        agent, notes = CLAUDE_CODE_SUBAGENT, {semconv.GEN_AI_AGENT_ID: sub, semconv.CALL_LINEAGE: "subagent"}
    users = [m for m in body.get("messages") or () if isinstance(m, dict) and m.get("role") == "user"]
    if users and _COMPACTION_ASK in _turn_text(users[-1]):
        agent, notes = CLAUDE_CODE_COMPACTION, {**notes, semconv.CALL_LINEAGE: "compaction"}
    elif users and _turn_text(users[0]).startswith(_COMPACTED_START):
        notes = {**notes, semconv.CALL_LINEAGE: "compacted"}
    if notes:
        count(f"claude_code_{notes[semconv.CALL_LINEAGE]}_calls")
    return agent, notes


CLAUDE_CODE_VERSION = "2.1.332"  # the version tested (examples/cli_agents/package.json)
#: Claude Code's traffic that is not its LLM calls (telemetry, error reports, update checks, the MCP
#: registry), off: a training machine often has no internet, and none of it belongs to a rollout.
CLAUDE_CODE_QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                     "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1"}


def find_cli(binary: str | None, program: str, env_var: str, package: str) -> str:
    """A coding-agent CLI's executable: ``binary``, else ``$env_var``, else ``program`` on PATH, else
    ``node_modules/.bin`` of the working folder (a local ``npm install``), else a checkout's pinned copy
    (``examples/cli_agents``, ``make node-deps``)."""
    local = Path.cwd() / "node_modules" / ".bin" / program
    checkout = Path(__file__).resolve().parents[2] / "examples" / "cli_agents" / "node_modules" / ".bin" / program
    for candidate in (binary,) if binary else (variable(env_var), shutil.which(program), local, checkout):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    if binary:  # the one given, and nothing else
        raise ConfigurationError(f"binary={binary!r} is not an executable file; give the path of {program} (after "
                                 f"npm install {package}: node_modules/.bin/{program})")
    raise ConfigurationError(f"no {program} executable found (${env_var}, PATH, ./node_modules/.bin); install it "
                             f"(npm install {package}) and run from that folder, or give binary='.../node_modules/"
                             f".bin/{program}' or set ${env_var}")


def served_model(upstream: str) -> str:
    """The first model an OpenAI-compatible engine serves (vLLM lists its base model first)."""
    import urllib.request

    url = upstream.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return orjson.loads(r.read())["data"][0]["id"]
    except Exception as exc:
        raise ConfigurationError(f"could not ask {url} which model it serves ({type(exc).__name__}: {exc}); give "
                                 "model='NAME' (the served policy every call is sent as)") from None


def _prompt_of(prompt: str | Callable[[Any], str] | None) -> Callable[[Any], str]:
    def render(task: Any) -> str:
        if callable(prompt):
            text = prompt(task)
        elif prompt is not None:
            text = prompt.format(**task) if isinstance(task, dict) else prompt.format(task=task)
        elif isinstance(task, str):
            text = task
        elif isinstance(task, dict) and isinstance(task.get("prompt"), str):
            text = task["prompt"]
        else:
            raise ConfigurationError(f"claude_code without prompt= takes the task as the prompt (a string, or a dict "
                                     f"with 'prompt'), got {str(task)[:200]!r}; give prompt='... {{field}} ...' or a "
                                     "function of the task")
        if not isinstance(text, str) or not text.strip():
            raise ConfigurationError(f"the prompt for task {str(task)[:200]!r} is empty or not a string: {text!r}")
        return text

    return render


def claude_code(prompt: str | Callable[[Any], str] | None = None, *, upstream: str | Sequence[str] | None = None,
                model: str | None = None, name: str = "claude-code", agent: str | None = None,
                tools: str | Sequence[str] | None = None, allowed_tools: str | Sequence[str] | None = None,
                system_prompt: str | None = None, max_turns: int | None = None, max_output_tokens: int = 4096,
                context_window: int | None = None, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike[str] | None = None, timeout: float | None = 600.0,
                reward: Callable[[Any, str], float | None] | None = None, mode: str | None = None,
                binary: str | None = None, sandbox: str | None = "bwrap") -> Callable[[Any], Any]:
    """Claude Code (``claude -p``) as a traced agent: ``lrl.command`` running the CLI once per task, every
    LLM call it makes (its main agent's, its sub-agents', its compactions') recorded through the gateway
    with the engine's token ids and log-probs, streamed as it streams.

    ``prompt``: the task's prompt, sent on stdin: a template (``"Fix {issue}"``, filled from a dict task),
    a function of the task, or None (the task is the prompt, or its ``"prompt"``). ``model``: the served
    policy every call is sent as, whatever name the CLI asks for (``claude-opus-*`` for the main model,
    another for the small one; the name asked is kept on the call); None: the endpoint's model
    (``upstream=None``) or the first model ``upstream`` serves. ``tools``/``allowed_tools``/
    ``system_prompt``/``max_turns`` are the CLI's ``--tools``/``--allowedTools``/``--system-prompt``/
    ``--max-turns`` (None: its defaults; ``tools=""``: none); in ``-p`` mode a tool that needs a permission
    runs only if ``allowed_tools`` names it. ``max_output_tokens`` caps each answer
    (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``: the CLI asks for up to 128,000, more than a local window holds);
    ``context_window`` is the served window, so that the CLI compacts before it overflows
    (``CLAUDE_CODE_MAX_CONTEXT_TOKENS``; it assumes 1M tokens for a model it does not know).
    ``reward(task, stdout)``: the rollout's reward from the CLI's output (its answer); else the caller's,
    sent to ``LIGHTNING_RL_REWARDS_URL`` or added later. Ends, timeouts and failures: ``lrl.command``'s.

    The CLI runs with its own configuration folder (``CLAUDE_CONFIG_DIR``, a temporary one unless ``env``
    gives one: your settings and logins are not read), no session files, and its non-LLM traffic off
    (``CLAUDE_CODE_QUIET``). ``binary``: the executable (else ``$LIGHTNING_RL_CLAUDE``, ``claude`` on PATH,
    a checkout's ``examples/cli_agents``); tested with version 2.1.332.

    ``sandbox``: by default the CLI runs in a ``bwrap`` sandbox (``lrl.command(sandbox=)``): the try's own when its
    runner gave it one, else a fresh one with a copy of ``cwd``, as its working folder; it reaches the gateway and
    nothing else, sees no home, project or secret of the host, and its configuration folder is in the sandbox's
    private ``/tmp``. ``sandbox="none"``: on the host, as this user (by name only)."""
    from .command import command  # late: command.py imports the app, which imports this module

    exe = find_cli(binary, "claude", ENV_CLI_BINARY["claude"], f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}")
    if model is None and upstream is not None:
        model = served_model(upstream if isinstance(upstream, str) else list(upstream)[0])
    if not isinstance(max_output_tokens, int) or max_output_tokens < 1:
        raise ConfigurationError(f"max_output_tokens must be an int >= 1, got {max_output_tokens!r}")
    argv = [exe, "-p", "--no-session-persistence"]
    for flag, value in (("--tools", tools), ("--allowedTools", allowed_tools)):
        if value is not None:
            argv += [flag, value if isinstance(value, str) else ",".join(value)]
    if system_prompt is not None:
        argv += ["--system-prompt", system_prompt]
    if max_turns is not None:
        argv += ["--max-turns", str(max_turns)]
    argv += list(extra_args)
    settings = {**CLAUDE_CODE_QUIET, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens)}
    if context_window is not None:
        settings["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(context_window)
    settings.update(env or {})
    jailed = sandbox not in (None, "none")
    settings.setdefault("CLAUDE_CONFIG_DIR", "/tmp/claude-code" if jailed else
                        tempfile.mkdtemp(prefix="claude-code-", dir=_root()))
    # no reward= : none (the CLI's last line is the model's answer, not a reward)
    return command(argv, upstream=upstream, name=name, agent=agent, env=settings, timeout=timeout, mode=mode,
                   reward=reward or _no_reward, model=model, stdin=_prompt_of(prompt), cwd=cwd,
                   sandbox=sandbox if jailed else None)


# --- Codex -------------------------------------------------------------------------------------------

# Run in the CLI's rollout process (stdlib only): reads the task, writes the CLI's isolated
# configuration pointing at the rollout's gateway URL (OPENAI_BASE_URL/OPENAI_API_KEY, set by
# lrl.command), runs the CLI in a working directory and removes what it wrote. argv: kind, binary,
# served model, root folder, sandbox (codex), extra CLI arguments.
_LAUNCHER = r'''
import json, os, shutil, signal, subprocess, sys, tempfile
kind, binary, model, root, sandbox, *extra = sys.argv[1:]
task = json.loads(sys.stdin.read() or "null")
prompt = task if isinstance(task, str) else task.get("prompt") if isinstance(task, dict) else None
if not isinstance(prompt, str) or not prompt.strip():
    sys.exit(f"lightning-rl {kind}: the task must be the prompt (a string) or a dict with a 'prompt' string "
             f"(and optionally 'cwd', an existing folder), got {json.dumps(task)[:200]}")
cwd = task.get("cwd") if isinstance(task, dict) else None
if os.environ.get("LIGHTNING_RL_SANDBOX_WORKDIR"):  # in a sandbox: the task's folder is its copy in there
    cwd = os.environ["LIGHTNING_RL_SANDBOX_WORKDIR"]
if cwd is not None and not (isinstance(cwd, str) and os.path.isdir(cwd)):
    sys.exit(f"lightning-rl {kind}: the task's cwd must be an existing folder, got {cwd!r}")
model = os.environ.get("LIGHTNING_RL_MODEL") or model
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
os.makedirs(root, exist_ok=True)
own = tempfile.mkdtemp(prefix=kind + "-", dir=root)
work = cwd or os.path.join(own, "work")
os.makedirs(work, exist_ok=True)
env = dict(os.environ, PWD=work)  # as a shell sets it: opencode takes its project folder from $PWD, not the cwd
q = json.dumps  # a TOML basic string is written as a JSON string
if kind == "codex":
    home = os.path.join(own, "codex-home")
    os.makedirs(home)
    with open(os.path.join(home, "config.toml"), "w") as f:
        f.write(f"""model = {q(model)}
model_provider = "lightning_rl"
web_search = "disabled"
check_for_update_on_startup = false
[analytics]
enabled = false
[model_providers.lightning_rl]
name = "lightning-rl gateway"
base_url = {q(base)}
env_key = "OPENAI_API_KEY"
wire_api = "responses"
""")
    env["CODEX_HOME"] = home
    argv = [binary, "exec", "--skip-git-repo-check", "--color", "never"]
    argv += ["--dangerously-bypass-approvals-and-sandbox"] if sandbox == "none" else ["--sandbox", sandbox]
    argv += [*extra, "--", prompt]
else:  # opencode: a provider per role, each naming it in the X-Lightning-RL-Agent header
    def provider(agent):
        return {"npm": "@ai-sdk/openai-compatible", "name": "lightning-rl gateway",
                "options": {"baseURL": base, "apiKey": key, "headers": {"X-Lightning-RL-Agent": agent}},
                "models": {model: {"name": model}}}
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "enabled_providers": ["lightning_rl", "lightning_rl_small", "lightning_rl_task"],
              "provider": {"lightning_rl": provider("opencode"), "lightning_rl_small": provider("opencode-small"),
                           "lightning_rl_task": provider("opencode-subagent")},
              "model": f"lightning_rl/{model}", "small_model": f"lightning_rl_small/{model}",
              "agent": {name: {"model": f"lightning_rl_task/{model}"} for name in ("general", "explore")}}
    config.update(json.loads(sandbox or "{}"))
    for var in ("DATA", "CONFIG", "CACHE", "STATE"):
        env[f"XDG_{var}_HOME"] = os.path.join(own, var.lower())
    env.update({"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                "OPENCODE_DISABLE_CLAUDE_CODE": "1", "OPENCODE_DISABLE_PROJECT_CONFIG": "1"})
    argv = [binary, "run", "--model", f"lightning_rl/{model}", *extra, "--", prompt]
try:
    proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL)
except OSError as exc:
    sys.exit(f"lightning-rl {kind}: cannot run {binary}: {exc}")
signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
try:
    code = proc.wait()
finally:
    shutil.rmtree(own, ignore_errors=True)
sys.exit(code)
'''

_ROOTS: list[str] = []


def _root() -> str:
    """This process's folder for the CLIs' configurations and working folders (removed at exit)."""
    if not _ROOTS:
        _ROOTS.append(tempfile.mkdtemp(prefix="lightning-rl-cli-"))
        atexit.register(shutil.rmtree, _ROOTS[0], True)
    return _ROOTS[0]


def _no_reward(task: Any, stdout: str) -> float | None:
    return None


# What Codex (0.171.0, captured from the real CLI) sends with each Responses request: its turn metadata, a
# JSON object in a header (and again in the body's client_metadata), with the agent's path (agent_name:
# "/root", or a path below it), its thread id, request_kind ("turn", "compaction"), window_number (0, then
# one more after each compaction) and, for a sub-agent's thread (its spawn_agent tool), thread_source
# "subagent", subagent_kind ("thread_spawn") and parent_thread_id.
CODEX_VERSION = "0.171.0"  # the versions tested (examples/cli_agents/package.json)
OPENCODE_VERSION = "1.18.33"
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
CODEX_AGENT = "codex"  # the agent name of the root agent's calls; a sub-agent's: "codex/<its name>"


def codex_lineage(headers: Mapping[str, str], body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A Responses request's line in a Codex session, from its turn metadata (``x-codex-turn-metadata``,
    else ``client_metadata``'s copy): ``(agent name or None, span attributes)``. The root agent's calls are
    agent ``codex``; a sub-agent's are ``codex/<its path below /root>``, or ``codex/<subagent_kind>``
    (``codex/thread_spawn``) when Codex gives it the root's path, with lineage ``subagent``; a compaction
    (``request_kind`` ``compaction``) keeps its agent, with lineage ``compaction``, and a call on a
    compacted context (``window_number`` above 0) says ``compacted``; each call has the
    thread id as ``gen_ai.agent.id`` (a sub-agent's is the ``agent_id`` its ``spawn_agent`` call answered).
    Lines counted (``codex_{line}_calls``). No metadata: ``(None, {})`` (every other client); metadata
    that is not a JSON object: the same, counted (``codex_turn_metadata_unreadable``)."""
    raw = headers.get(CODEX_METADATA_HEADER)
    if raw is None and isinstance(body.get("client_metadata"), dict):
        raw = body["client_metadata"].get(CODEX_METADATA_HEADER)
    if raw is None:
        return None, {}
    try:
        meta = json.loads(raw)
    except (TypeError, ValueError):
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("agent_name", ""), str):
        count("codex_turn_metadata_unreadable")
        return None, {}
    path = [p for p in meta.get("agent_name", "").split("/") if p]
    path = path[1:] if path[:1] == ["root"] else path
    sub = bool(path) or meta.get("thread_source") == "subagent" or bool(meta.get("parent_thread_id"))
    if sub and not path:
        path = [str(meta.get("subagent_kind") or "subagent")]
    notes: dict[str, Any] = {}
    if isinstance(meta.get("thread_id"), str):
        notes[semconv.GEN_AI_AGENT_ID] = meta["thread_id"]
    window = meta.get("window_number")
    if meta.get("request_kind") == "compaction":
        notes[semconv.CALL_LINEAGE] = "compaction"
    elif isinstance(window, int) and window > 0:  # its context window after a compaction (the first is 0)
        notes[semconv.CALL_LINEAGE] = "compacted"
    elif sub:
        notes[semconv.CALL_LINEAGE] = "subagent"
    if semconv.CALL_LINEAGE in notes:
        count(f"codex_{notes[semconv.CALL_LINEAGE]}_calls")
    return "/".join([CODEX_AGENT, *path]), notes


def _cli(kind: str, program: str, package: str, extra: Sequence[str], sandbox: str, *, binary: str | None,
         model: str | None, upstream: str | Sequence[str] | None, name: str | None, agent: str | None,
         env: Mapping[str, str] | None, timeout: float | None, mode: str | None,
         reward: Callable[[Any, str], float | None] | None, where: str = "bwrap") -> Callable[[Any], Any]:
    if isinstance(extra, str) or not all(isinstance(a, str) for a in extra):
        raise ConfigurationError(f"{kind}: args must be a list of strings (extra {program} arguments), got {extra!r}")
    if upstream is not None and not (isinstance(model, str) and model):
        raise ConfigurationError(f"{kind}(upstream=...) needs model=, the name the engine serves the policy under "
                                  f"(every model {program} asks for is this one), got {model!r}")
    from .command import command as _command  # late: command.py imports the app, which imports this module

    exe = find_cli(binary, program, ENV_CLI_BINARY[program], package)
    jailed = where != "none"
    # in a sandbox the launcher runs with the system's python3 (the trainer's is not in there; it needs only the
    # standard library), its folders in the sandbox's private /tmp, the task's folder its copy at /work
    python, root = ("python3", "/tmp/lightning-rl-cli") if jailed else (sys.executable, _root())
    argv = [python, "-c", _LAUNCHER, kind, exe, model or "", root, sandbox, *extra]
    more = {**(env or {}), ENV_SANDBOX_WORKDIR: "/work"} if jailed else env
    # model: the CLI's configuration asks for it; the gateway sends any other name it asks for as it too
    return _command(argv, upstream=upstream, name=name or kind, agent=agent, env=more, timeout=timeout, mode=mode,
                    reward=reward or _no_reward, model=model, label=f"{exe} {'exec' if kind == 'codex' else 'run'}",
                    sandbox=where if jailed else None, sandbox_folder=_task_folder if jailed else None,
                    read_only=[exe])


def _task_folder(task: Any) -> str | None:
    """The folder a CLI's task names (``{"prompt": ..., "cwd": FOLDER}``): what its sandbox gets a copy of."""
    cwd = task.get("cwd") if isinstance(task, dict) else None
    return cwd if isinstance(cwd, str) and os.path.isdir(cwd) else None


def codex(*, upstream: str | Sequence[str] | None = None, model: str | None = None, binary: str | None = None,
          sandbox: str = "bwrap", args: Sequence[str] = (), name: str | None = None, agent: str | None = None,
          env: Mapping[str, str] | None = None, timeout: float | None = None, mode: str | None = None,
          reward: Callable[[Any, str], float | None] | None = None) -> Callable[[Any], Any]:
    """Codex (``codex exec``, the Responses API) as a traced agent ``agent(task)``: a ``lrl.command``.

    The task is the prompt (a string) or ``{"prompt": ..., "cwd": FOLDER}`` (default: a new empty folder,
    removed after). Each rollout gets a ``CODEX_HOME`` of its own whose ``config.toml`` names one model
    provider, the rollout's gateway URL (``wire_api = "responses"``, the key from ``OPENAI_API_KEY``), and
    one model, ``model`` (the served policy's name; ``upstream=None``: the endpoint's), so every call Codex
    makes (its turns, compaction, sub-agents) asks for it, and is recorded with its agent and line
    (:func:`codex_lineage`: ``codex``, ``codex/thread_spawn``, ``compaction``); web search (OpenAI's
    hosted tool), analytics and the update check are off. ``sandbox``: ``"bwrap"`` (the default: the CLI runs in
    the try's bwrap sandbox, as ``lrl.claude_code`` does, reaching only the gateway, with its own sandbox off:
    ``--dangerously-bypass-approvals-and-sandbox``), ``"none"`` (on the host, its own sandbox off: for a machine
    that is itself the sandbox) or one of Codex's own ``--sandbox`` modes on the host (``read-only``,
    ``workspace-write``, ``danger-full-access``). The task's ``cwd`` is copied into the sandbox (``/work``). ``args``: more ``codex exec`` arguments (``-c key=value`` overrides).
    ``binary``: the ``codex`` executable (else ``$LIGHTNING_RL_CODEX``, ``codex`` on PATH, a checkout's
    ``examples/cli_agents``). The reward: ``reward(task, final message)``
    (Codex prints its last message on stdout), else none: a number Codex answers is not a reward. A
    non-zero exit fails the rollout, ``timeout`` ends it; the calls so far stay recorded."""
    if sandbox not in ("bwrap", "none", "read-only", "workspace-write", "danger-full-access"):
        raise ConfigurationError(f"codex sandbox must be 'bwrap', 'none', 'read-only', 'workspace-write' or "
                                  f"'danger-full-access', got {sandbox!r}")
    return _cli("codex", "codex", f"@openai/codex@{CODEX_VERSION}", args, "none" if sandbox == "bwrap" else sandbox,
                binary=binary, model=model, upstream=upstream, name=name, agent=agent, env=env, timeout=timeout,
                mode=mode, reward=reward, where="bwrap" if sandbox == "bwrap" else "none")


# --- opencode ----------------------------------------------------------------------------------------


def opencode(*, upstream: str | Sequence[str] | None = None, model: str | None = None, binary: str | None = None,
             config: Mapping[str, Any] | None = None, args: Sequence[str] = (), name: str | None = None,
             agent: str | None = None, env: Mapping[str, str] | None = None, timeout: float | None = None,
             mode: str | None = None, reward: Callable[[Any, str], float | None] | None = None,
             sandbox: str | None = "bwrap") -> Callable[[Any], Any]:
    """opencode (``opencode run``, chat completions through ``@ai-sdk/openai-compatible``) as a traced
    agent ``agent(task)``: a ``lrl.command``.

    The task is as for :func:`codex`. Each rollout gets its own configuration (``OPENCODE_CONFIG_CONTENT``,
    XDG folders of its own, the project's config ignored): three providers at the rollout's gateway URL,
    each serving ``model`` (the served policy's name), so that every call asks for it and is recorded with
    its role as the call's agent (``X-Lightning-RL-Agent``): ``opencode`` (the main agent),
    ``opencode-small`` (``small_model``: the session title) and ``opencode-subagent`` (the ``general`` and
    ``explore`` sub-agents its ``task`` tool starts). models.dev, the update check, LSP downloads, sharing
    and the default plugins are off. ``config``: more opencode configuration, merged over ours (e.g.
    ``{"permission": {"bash": "deny"}}``). ``args``: more ``opencode run`` arguments. The reward as for
    :func:`codex` (``stdout``: what ``opencode run`` printed). ``sandbox``: ``"bwrap"`` (the default: in the try's
    sandbox, reaching only the gateway, the task's ``cwd`` copied to ``/work``) or ``"none"`` (on the host)."""
    if config is not None and not isinstance(config, Mapping):
        raise ConfigurationError(f"opencode config must be a dict of opencode configuration, got {config!r}")
    return _cli("opencode", "opencode", f"opencode-ai@{OPENCODE_VERSION}", args, json.dumps(dict(config or {})),
                binary=binary, model=model, upstream=upstream, name=name, agent=agent, env=env, timeout=timeout,
                mode=mode, reward=reward, where=sandbox or "none")
