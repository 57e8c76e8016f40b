"""``lightning-rl train verl``: verl's own trainer (``verl.trainer.main_ppo``) with our config (``run_verl``).

The packaged Hydra config (``config/lightning_rl_grpo.yaml``) extends verl's ``ppo_trainer``:
GRPO, rollout correction from the engine's log-probs, and the ``lightning_rl`` agent loop as the
default, so verl's Ray workers run the user's traced agent against verl's vLLM servers. Any Hydra
override can be appended (``data.train_files=...``, ``trainer.n_gpus_per_node=8``, ...).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError
from ...settings import ENV_STORE, store_url
from ...store.uri import parse_store_url, redacted, store_backend

SUPPORTED = (">=0.9.1", "<0.10")
RANGE = "verl>=0.9.1,<0.10"
CONFIG_DIR = Path(__file__).with_name("config")
CONFIG_NAME = "lightning_rl_grpo"


def check_verl_version(version: str | None = None) -> str:
    """The installed verl version, or an error that names the supported range and the fix.

    verl 0.9.0 is refused: its load balancer's ``_release_server`` takes no request id and its V1 trainer
    predates what the rows here are checked against (0.9.1's ``agent_loop_tq`` and ``trainer_base``)."""
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("verl")
        except Exception:
            raise ConfigurationError(
                f"verl is not installed; pip install 'lightning-rl[verl]' (supported: {RANGE})"
            ) from None
    parts = version.split(".")
    try:
        release = tuple(int(re.match(r"\d+", x).group()) for x in parts[:3])  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        raise ConfigurationError(f"cannot read verl version {version!r}; supported: {RANGE}") from None
    if not (0, 9, 1) <= release + (0,) * (3 - len(release)) < (0, 10):
        raise ConfigurationError(
            f"verl {version} is installed, but lightning-rl's verl bridge supports {RANGE} (tested with 0.9.1); "
            "pip install 'verl>=0.9.1,<0.10'"
        )
    return version


VLLM_MIN = (0, 18)  # verl 0.9 drives vLLM >= 0.18 (its AsyncLLM server API)


def check_vllm_version(version: str | None = None) -> str | None:
    """On the training machines verl runs vLLM in-process; check its version when installed."""
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("vllm")
        except Exception:
            return None  # vLLM comes with verl's GPU stack; nothing to check on this machine
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        raise ConfigurationError(f"cannot read vLLM version {version!r}; verl 0.9 needs vllm>=0.18") from None
    if (major, minor) < VLLM_MIN:
        raise ConfigurationError(
            f"vLLM {version} is installed, but verl 0.9 (and so lightning-rl's verl bridge) needs vllm>=0.18; "
            "pip install 'vllm>=0.18'"
        )
    return version


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg``'s value at the dotted ``key`` (an OmegaConf config or nested mappings), or ``default``."""
    node = cfg
    for part in key.split("."):
        try:
            node = node.get(part) if hasattr(node, "get") else None
        except Exception:  # noqa: BLE001 - a missing interpolation reads as unset here
            return default
        if node is None:
            return default
    return node


def served_model_name(cfg: Any) -> str:
    """The model name verl's vLLM servers answer to on their OpenAI routes: the model path, or
    ``rollout.prometheus.served_model_name`` (its last path part) when verl's prometheus is on."""
    rollout = "actor_rollout_ref.rollout.prometheus"
    if _get(cfg, f"{rollout}.enable", False) and _get(cfg, f"{rollout}.served_model_name"):
        return str(_get(cfg, f"{rollout}.served_model_name")).split("/")[-1]
    return str(_get(cfg, "actor_rollout_ref.model.path", ""))


def _lora_rank(cfg: Any) -> int:
    model = "actor_rollout_ref.model"
    return int(_get(cfg, f"{model}.lora.rank", 0) or 0) or int(_get(cfg, f"{model}.lora_rank", 0) or 0)


#: The settings under ``lightning_rl`` in verl's config (``config/lightning_rl_grpo.yaml`` documents each).
LIGHTNING_RL_KEYS = frozenset({"agent", "store", "rollouts", "external_timeout", "agents", "credit", "failure_reward",
                               "infra_errors", "model", "server_url", "guided_decoding"})
GUIDED_DECODING = ("mask", "train")


#: verl settings lightning-rl needs at one value (verl's default where it is that value): the key, the value, why.
_NEEDED = (
    ("trainer.v1.trainer_mode", "sync", "in verl's async modes the agent's HTTP calls bypass verl's admission gate "
     "during weight sync and are never aborted, so a row could mix weights with no version saying so"),
    ("actor_rollout_ref.rollout.name", "vllm", "lightning-rl records the engine's token ids and log-probs from vLLM's "
     "OpenAI routes (return_token_ids), which this engine's OpenAI routes do not return"),
    ("actor_rollout_ref.rollout.mode", "async", "verl runs agent loops (and so lightning-rl's) only with its OpenAI "
     "servers"),
    ("algorithm.adv_estimator", "grpo", "lightning-rl computes verl's advantages itself (infrastructure failures out "
     "of the batch, each segment's own reward after credit: docs/verl.md) and does so for GRPO only"),
)


def check_verl_config(cfg: Any) -> None:
    """Refuse, with one line naming the setting and the fix, a verl configuration under which the rows would
    be lost or would train the wrong thing. Called at launch (``main``) and by the agent loop."""
    ours = _get(cfg, "lightning_rl", {}) or {}
    unknown = sorted(set(ours) - LIGHTNING_RL_KEYS) if hasattr(ours, "keys") else []
    if unknown:
        raise ConfigurationError(f"lightning_rl.{unknown[0]} is not a lightning-rl setting; known: "
                                 f"{', '.join(sorted(LIGHTNING_RL_KEYS))}")
    if not _get(cfg, "trainer.use_v1", True):
        raise ConfigurationError(
            "trainer.use_v1=false: verl's legacy trainer takes one row per try, so the earlier segments of a "
            "multi-turn rollout whose token prefix broke would not be trained; drop trainer.use_v1=false (V1 is "
            "verl 0.9's default)")
    for key, needed, why in _NEEDED:
        value = _get(cfg, key, needed)
        if str(value) != needed:
            raise ConfigurationError(f"{key}={value}: {why}; use {key}={needed}")
    if _lora_rank(cfg) > 0 and not _get(cfg, "actor_rollout_ref.model.lora.merge", False):
        raise ConfigurationError(
            f"LoRA rank {_lora_rank(cfg)} with actor_rollout_ref.model.lora.merge=false: verl attaches the adapter "
            "on its token path only, so the OpenAI routes the agent calls would sample from the base model while the "
            "actor trains the LoRA; set actor_rollout_ref.model.lora.merge=true")
    guided = str(_get(cfg, "lightning_rl.guided_decoding", "mask"))
    if guided not in GUIDED_DECODING:
        raise ConfigurationError(f"lightning_rl.guided_decoding={guided} is not one of {', '.join(GUIDED_DECODING)}: mask "
                                 "(a segment sampled under a grammar has no gradient) or train (trained on anyway)")
    if _get(cfg, "algorithm.use_kl_in_reward", False):
        raise ConfigurationError(
            "algorithm.use_kl_in_reward=true: lightning-rl's advantage reads each segment's own reward, not verl's "
            "KL-penalised token rewards, so the penalty would be dropped; use a KL loss instead "
            "(actor_rollout_ref.actor.use_kl_loss=true) and algorithm.use_kl_in_reward=false")
    if _get(cfg, "reward.reward_model.enable", False):
        raise ConfigurationError(
            "reward.reward_model.enable=true: the agent's own rewards (returned, emitted, late) are what lightning-rl "
            "trains on, and verl's reward model would overwrite them (colocated) or be ignored; score in the agent "
            "(lrl.emit_reward, a reward function) and set reward.reward_model.enable=false")
    if _get(cfg, "lightning_rl.store"):
        _refuse_secret_in_config(str(_get(cfg, "lightning_rl.store")))
    nodes = int(_get(cfg, "trainer.nnodes", 1) or 1)
    store = _get(cfg, "lightning_rl.store") or store_url()
    if nodes > 1 and not store_backend(str(store)).shared:
        raise ConfigurationError(_shared_store_message(nodes, str(store)))


def check_launch_inputs(cfg: Any) -> None:
    """What only the launching machine can check before Ray starts: the agent imports (where verl's workers run
    it) and local dataset files exist. One line naming the setting and the fix."""
    from ..agent_loading import load_agent

    rollouts = _get(cfg, "lightning_rl.rollouts", "in_worker")
    agent = _get(cfg, "lightning_rl.agent")
    if rollouts == "in_worker":
        if not agent:
            raise ConfigurationError("set the traced agent verl's workers run: --agent my_pkg.agents:solve "
                                     "(lightning_rl.agent), or lightning_rl.rollouts=external")
        load_agent(str(agent))
    for key in ("data.train_files", "data.val_files"):
        files = _get(cfg, key)
        for name in ([files] if isinstance(files, str) else list(files or [])):
            name = str(name)
            if "://" not in name and not Path(os.path.expanduser(name)).exists():
                raise ConfigurationError(f"{key}={name} does not exist here; give tasks with --tasks FILE (JSON lines: "
                                         f"written as verl's parquet) or {key}= an existing parquet file")


def _shared_store_message(nodes: int, target: str) -> str:
    return (f"a run on {nodes} nodes needs a store every node can write, but {target!r} is a SQLite "
            "file: its locks and WAL do not work across machines (not even on a shared filesystem). Run "
            "`lightning-rl store serve --db runs.db --host 0.0.0.0 --token $TOKEN` on one node and pass "
            "--store http://THAT_NODE:8765 (with LIGHTNING_RL_STORE_TOKEN in this shell: the launch hands it to "
            "verl's Ray actors), or a postgresql:// store")


def _nodes(overrides: Sequence[str]) -> int:
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        if key == "trainer.nnodes":
            try:
                return int(value)
            except ValueError:
                raise ConfigurationError(f"trainer.nnodes={value!r} is not a number of nodes") from None
    return 1


def _quoted(value: str) -> str:
    """A Hydra override value, quoted where Hydra would read it otherwise (a comma makes a sweep)."""
    return value if not re.search(r"[,\[\]{}()'\"\\= ]", value) else "'" + re.sub(r"(['\\])", r"\\\1", value) + "'"


def verl_command(agent: str | None, overrides: Sequence[str] = (), *, store: str | None = None) -> list[str]:
    """The command ``lightning-rl train verl`` runs: ``main`` (verl's ``main_ppo``, checked and wired) with the
    packaged config, the agent and the Hydra ``overrides``. ``agent`` may be None only with
    ``lightning_rl.rollouts=external`` (runners elsewhere run it). The store is not in it: it goes to verl's
    processes in their environment (``verl_env``), because verl prints its config and hands it to the
    experiment trackers, and a store URL may hold a password."""
    external = any(o.lstrip("+").replace(" ", "") == "lightning_rl.rollouts=external" for o in overrides)
    if agent is None and not external:
        raise ConfigurationError("--agent module:function is needed (the traced agent verl's workers run), unless "
                                 "runners elsewhere run it: lightning_rl.rollouts=external")
    if agent is not None and ":" not in agent:
        raise ConfigurationError(f"--agent must be module:function of a traced agent, got {agent!r}")
    target = launch_store(store)
    if _nodes(overrides) > 1 and not store_backend(target).shared:
        raise ConfigurationError(_shared_store_message(_nodes(overrides), target))
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        if key == "lightning_rl.store":
            _refuse_secret_in_config(value)
    args = [sys.executable, "-m", "lightning_rl.trainer_bridge.verl.main", "--config-path", str(CONFIG_DIR),
            "--config-name", CONFIG_NAME,
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={CONFIG_DIR / 'agent_loops.yaml'}"]
    if agent is not None:
        args.append(f"lightning_rl.agent={agent}")
    return args + list(overrides)


def launch_store(store: str | None = None) -> str:
    """The store the run writes to: ``store`` (``--store``), else ``LIGHTNING_RL_STORE``, else the default; a
    SQLite file by its absolute path (verl's actors may run in another directory)."""
    target = store or store_url()
    backend = store_backend(target)
    if backend.absolute_url is not None:
        target = backend.absolute_url(parse_store_url(target)[1])
    return target


def verl_env(store: str | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment verl's run gets: this one, with ``LIGHTNING_RL_STORE`` set to the run's store
    (``launch_store``). ``verl.main`` hands every ``LIGHTNING_RL_*`` variable to verl's Ray actors
    (``main.worker_env``), so the store's URL and token reach the agent loops and the trainer and never
    enter verl's config."""
    env = dict(os.environ if environ is None else environ)
    env[ENV_STORE] = launch_store(store or env.get(ENV_STORE))
    return env


_SECRET_PARAM = re.compile(r"([?&](?:password|token|secret)=)[^&]*", re.I)


def _refuse_secret_in_config(value: str) -> None:
    shown = _SECRET_PARAM.sub(r"\1***", redacted(str(value)))
    if shown != str(value):
        raise ConfigurationError(
            f"lightning_rl.store={shown} holds a password: verl prints its whole config and hands it "
            "to the experiment trackers (W&B, MLflow); give the store with --store or LIGHTNING_RL_STORE in the "
            "environment: lightning-rl hands it to verl's workers through their environment")


def data_overrides(tasks: Sequence[Any] | None, val_tasks: Sequence[Any] | None, data_dir: str | Path,
                   overrides: Sequence[str] = ()) -> list[str]:
    """Write ``tasks`` (and ``val_tasks``) as verl's parquet under ``data_dir`` (``data``) and return the
    overrides that point verl at them. Without validation tasks verl still needs a validation file (the
    training one) and does not validate, unless ``overrides`` say otherwise."""
    if tasks is None:
        return []
    from .data import write_verl_dataset

    given = {o.lstrip("+").partition("=")[0] for o in overrides}
    clash = sorted({"data.train_files", "data.val_files"} & given)
    if clash:
        raise ConfigurationError(f"--tasks writes verl's dataset files itself, and {', '.join(clash)} names others; "
                                 "give either --tasks (and --val-tasks) or the parquet files, not both")
    data_dir = Path(data_dir).resolve()  # verl's actors may run in another directory
    train = write_verl_dataset(tasks, data_dir / "train.parquet", split="train")
    out = [f"data.train_files={_quoted(str(train))}"]
    if val_tasks:
        val = write_verl_dataset(val_tasks, data_dir / "val.parquet", split="val")
        out.append(f"data.val_files={_quoted(str(val))}")
    else:
        out.append(f"data.val_files={_quoted(str(train))}")
        out += [o for o in ("trainer.val_before_train=false", "trainer.test_freq=-1") if o.partition("=")[0] not in given]
    return out


def composed_config(command: Sequence[str]) -> Any:
    """verl's config as ``main`` will compose it from ``command`` (``verl_command``'s), for the checks."""
    from hydra import compose, initialize_config_dir

    overrides = [arg for arg in command[command.index(CONFIG_NAME) + 1:]]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(CONFIG_NAME, overrides=overrides)


def run_verl(agent: str | None, overrides: Sequence[str] = (), *, store: str | None = None,
             tasks: Sequence[Any] | None = None, val_tasks: Sequence[Any] | None = None,
             data_dir: str | Path = "lightning_rl_verl_data") -> int:
    """Run verl's trainer (``main``) over the traced agent ``agent`` (``module:function``) with the packaged
    config and the Hydra ``overrides``, after checking the installed verl and vLLM versions; ``tasks``
    (``val_tasks``) are written as verl's dataset first (``data_overrides``). Returns verl's exit status."""
    verl_command(agent, overrides, store=store)  # the arguments first: a mistake in them is named before the rest
    check_verl_version()
    check_vllm_version()
    command = verl_command(agent, [*overrides, *data_overrides(tasks, val_tasks, data_dir, overrides)], store=store)
    return subprocess.call(command, env=verl_env(store))
