"""``lightning-rl train verl``: verl's own trainer (``verl.trainer.main_ppo``) with our config (``run_verl``).

The packaged Hydra config (``verl_config/lightning_rl_grpo.yaml``) extends verl's ``ppo_trainer``:
GRPO, rollout correction from the engine's log-probs, and the ``lightning_rl`` agent loop as the
default, so verl's Ray workers run the user's traced agent against verl's vLLM servers. Any Hydra
override can be appended (``data.train_files=...``, ``trainer.n_gpus_per_node=8``, ...).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigurationError
from ..settings import DEFAULT_STORE, ENV_STORE
from ..store.uri import store_kind

SUPPORTED = (">=0.9", "<0.10")
CONFIG_DIR = Path(__file__).with_name("verl_config")
CONFIG_NAME = "lightning_rl_grpo"


def check_verl_version(version: str | None = None) -> str:
    """The installed verl version, or an error that names the supported range and the fix."""
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("verl")
        except Exception:
            raise ConfigurationError(
                "verl is not installed; pip install 'lightning-rl[verl]' (supported: verl>=0.9,<0.10)"
            ) from None
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ConfigurationError(f"cannot read verl version {version!r}; supported: verl>=0.9,<0.10") from None
    if (major, minor) != (0, 9):
        raise ConfigurationError(
            f"verl {version} is installed, but lightning-rl's verl bridge supports verl>=0.9,<0.10 (tested with 0.9.1); "
            "pip install 'verl>=0.9,<0.10'"
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


def _nodes(overrides: Sequence[str]) -> int:
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        if key == "trainer.nnodes":
            try:
                return int(value)
            except ValueError:
                raise ConfigurationError(f"trainer.nnodes={value!r} is not a number of nodes") from None
    return 1


def verl_command(agent: str, overrides: Sequence[str] = (), *, store: str | None = None) -> list[str]:
    if ":" not in agent:
        raise ConfigurationError(f"--agent must be module:function of a traced agent, got {agent!r}")
    target = store or os.environ.get(ENV_STORE) or DEFAULT_STORE
    if _nodes(overrides) > 1 and store_kind(target) not in ("http", "postgres"):
        raise ConfigurationError(
            f"a run on {_nodes(overrides)} nodes needs a store every node can write, but {target!r} is a SQLite "
            "file: its locks and WAL do not work across machines (not even on a shared filesystem). Run "
            "`lightning-rl store serve --db runs.db --host 0.0.0.0 --token $TOKEN` on one node and pass "
            "--store http://THAT_NODE:8765 (and LIGHTNING_RL_STORE_TOKEN on every node), or a postgresql:// store")
    args = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR),
            "--config-name", CONFIG_NAME, f"lightning_rl.agent={agent}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={CONFIG_DIR / 'agent_loops.yaml'}"]
    if store:  # quoted where Hydra would read it otherwise: a comma (several servers) makes a sweep
        quoted = store if not re.search(r"[,\[\]{}()'\"\\= ]", store) else "'" + re.sub(r"(['\\])", r"\\\1", store) + "'"
        args.append(f"lightning_rl.store={quoted}")
    return args + list(overrides)


def run_verl(agent: str, overrides: Sequence[str] = (), *, store: str | None = None) -> int:
    """Run verl's trainer over the traced agent ``agent`` (``module:function``) with the packaged config and
    the Hydra ``overrides`` (``verl_command``), after checking the installed verl and vLLM versions;
    returns its exit status."""
    command = verl_command(agent, overrides, store=store)
    check_verl_version()
    check_vllm_version()
    return subprocess.call(command, env=os.environ.copy())
