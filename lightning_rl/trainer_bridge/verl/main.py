"""``python -m lightning_rl.trainer_bridge.verl.main``: verl's own ``main_ppo``, checked and wired for lightning-rl.

``lightning-rl train verl`` runs this module with the packaged Hydra config (``config/``) and the
user's overrides. It does what verl's ``main_ppo.main`` does (``auto_set_device``, ``validate_config``,
``run_ppo``), after :func:`prepare`:

* refuses a configuration that would lose rows or train the wrong thing (``launch.check_verl_config``),
  an agent that does not import and dataset files that do not exist (``check_launch_inputs``): one line naming
  the setting and the fix, before Ray or a GPU is touched;
* runs verl's V1 sync trainer with each weight sync recorded as a publish (``trainer``), numbered from the run's
  version base (``runs.py``: after every version of the served name already in the store), handed to every
  verl process as ``LIGHTNING_RL_VERL_VERSION_BASE``;
* runs verl's ``TaskRunnerV1`` through ``run_ppo``'s own extension point (``task_runner_class``) as an actor
  whose runtime environment carries this shell's ``LIGHTNING_RL_*`` variables and ``PYTHONPATH`` with the current
  directory first. Ray hands an actor's runtime environment to the actors it starts, so verl's agent-loop workers
  have them even on a cluster started by ``ray start`` in another shell. The store's URL and token are not among
  them: Ray logs every actor's runtime environment, so they go in a file of mode 0600 that
  ``LIGHTNING_RL_SECRETS_FILE`` names (``secrets_env``). Neither enters verl's config, which verl prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from ...errors import ConfigurationError
from ...settings import ENV_SECRETS_DIR, ENV_SECRETS_FILE, ENV_VERL_VERSION_BASE, SECRET_VARIABLES, secrets_dir, variable
from .launch import CONFIG_NAME, check_launch_inputs, check_verl_config, check_verl_version, served_model_name
from .runs import new_version_base


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What verl's Ray actors get from the launching shell: ``LIGHTNING_RL_*`` and ``PYTHONPATH`` (the current
    directory first, as ``python -m`` finds the agent's module); the secret ones (the store's URL and token:
    ``settings.SECRET_VARIABLES``) are left out, for ``secrets_env``."""
    environ = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in environ.items() if k.startswith("LIGHTNING_RL_") and k not in SECRET_VARIABLES}
    paths = [os.getcwd(), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


@contextlib.contextmanager
def secrets_env(nodes: int = 1) -> Iterator[dict[str, str]]:
    """The variables that hand verl's processes the store's URL and token without their values: Ray logs every
    actor's runtime environment (``runtime_env_agent.log``: seen there, 2026-11-28), so the values go in a JSON
    file of mode 0600 (``LIGHTNING_RL_SECRETS_FILE``, which ``settings.variable`` reads), removed at the end. On
    several nodes the file must be where every node reads it: ``LIGHTNING_RL_SECRETS_DIR``."""
    secrets = {k: value for k in sorted(SECRET_VARIABLES) if (value := variable(k))}
    if not secrets:
        yield {}
        return
    shared = secrets_dir()
    if nodes > 1 and not shared:
        raise ConfigurationError(
            f"a run on {nodes} nodes: the store's URL and token go to verl's processes in a file (Ray logs their "
            f"environment), which every node must read; set {ENV_SECRETS_DIR}= a folder every node mounts")
    sweep_secrets(shared)
    folder = tempfile.mkdtemp(prefix=f"lightning-rl-verl-{os.getpid()}-", dir=shared)  # mode 0700
    path = os.path.join(folder, "secrets.json")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(secrets, f)
        yield {ENV_SECRETS_FILE: path}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def prepare(config: DictConfig) -> DictConfig:
    """Check ``config`` (``check_verl_config``) and what only this machine can check before Ray starts (the agent
    imports, the dataset files exist: ``check_launch_inputs``); returns it."""
    check_verl_config(config)
    check_launch_inputs(config)
    return config


def task_runner(env: dict[str, str]) -> Any:
    """verl's ``TaskRunnerV1`` as a Ray actor with ``env`` whose ``sync`` trainer publishes each weight sync."""
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_metadata__.modified_class.__ray_actor_class__  # the class before ray.remote

    class LightningRLTaskRunner(base):  # type: ignore[misc, valid-type]
        def run(self, config: DictConfig) -> None:
            from .trainer import use_in_this_process

            use_in_this_process()
            super().run(config)

    return ray.remote(LightningRLTaskRunner).options(runtime_env={"env_vars": env})


@hydra.main(config_path="config", config_name=CONFIG_NAME, version_base=None)
def main(config: DictConfig) -> None:
    try:
        check_verl_version()
        prepare(config)
    except ConfigurationError as exc:  # one line, no traceback (Hydra would print one for an exception)
        raise SystemExit(f"Error: {exc}") from None
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    env = worker_env()
    env[ENV_VERL_VERSION_BASE] = str(run_version_base(config))
    try:
        with secrets_env(int(config.trainer.get("nnodes", 1) or 1)) as secret:
            run_ppo(config, task_runner_class=task_runner({**env, **secret}))
    except ConfigurationError as exc:
        raise SystemExit(f"Error: {exc}") from None


def sweep_secrets(folder: str | None = None) -> list[str]:
    """Remove the secrets folders of launches that are gone (a run killed with -9 never reaches its ``finally``):
    ``lightning-rl-verl-PID-*`` in ``folder`` (default: the temporary folder) whose PID is no longer running.
    Returns what was removed."""
    removed = []
    for path in Path(folder or tempfile.gettempdir()).glob("lightning-rl-verl-*"):
        pid = path.name.split("-")[3] if path.name.count("-") >= 4 else ""
        if not pid.isdigit():  # an older launch's (no PID in its name): its run has ended or it is this machine's
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
        except PermissionError:  # another user's, running
            pass
    return removed


def run_version_base(config: DictConfig) -> int:
    """This run's version base (``runs.py``), read from the store the run writes to."""
    from ..._api import open_store

    with open_store(config.lightning_rl.get("store") or None) as store:  # None: LIGHTNING_RL_STORE
        return new_version_base(store, served_model_name(config), str(config.trainer.default_local_dir))


if __name__ == "__main__":
    main()
