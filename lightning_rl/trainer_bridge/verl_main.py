"""``python -m lightning_rl.trainer_bridge.verl_main``: verl's own ``main_ppo``, checked and wired for lightning-rl.

``lightning-rl train verl`` runs this module with the packaged Hydra config (``verl_config/``) and the
user's overrides. It does what verl's ``main_ppo.main`` does (``auto_set_device``, ``validate_config``,
``run_ppo``), after :func:`prepare`:

* refuses a configuration that would lose rows or train the wrong thing (``verl_launch.check_verl_config``),
  an agent that does not import and dataset files that do not exist (``check_launch_inputs``): one line naming
  the setting and the fix, before Ray or a GPU is touched;
* runs verl's V1 sync trainer with each weight sync recorded as a publish (``verl_trainer``);
* runs verl's ``TaskRunnerV1`` through ``run_ppo``'s own extension point (``task_runner_class``) as an actor
  whose runtime environment carries this shell's ``LIGHTNING_RL_*`` variables (the store's token among them)
  and ``PYTHONPATH`` with the current directory first. Ray hands an actor's runtime environment to the actors
  it starts, so verl's agent-loop workers have them even on a cluster started by ``ray start`` in another
  shell. They never enter verl's config, which verl prints.
"""

from __future__ import annotations

import os
from typing import Any

import hydra
from omegaconf import DictConfig

from ..errors import ConfigurationError
from .verl_launch import CONFIG_NAME, check_launch_inputs, check_verl_config, check_verl_version


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What verl's Ray actors get from the launching shell: ``LIGHTNING_RL_*`` and ``PYTHONPATH`` (the current
    directory first, as ``python -m`` finds the agent's module)."""
    environ = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in environ.items() if k.startswith("LIGHTNING_RL_")}
    paths = [os.getcwd(), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


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
            from .verl_trainer import use_in_this_process

            use_in_this_process()
            super().run(config)

    return ray.remote(LightningRLTaskRunner).options(runtime_env={"env_vars": env})


@hydra.main(config_path="verl_config", config_name=CONFIG_NAME, version_base=None)
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
    run_ppo(config, task_runner_class=task_runner(worker_env()))


if __name__ == "__main__":
    main()
