"""Runners as Ray actors, for rollouts spread over a Ray cluster (the one verl trains on, say).

Each actor is a :class:`Runner` in its own worker process, writing through store servers
(``http://``: one, or several serving one store, as a list or comma-separated, to move to the next when
one fails; ``postgresql://`` straight to the database works too, with the ``postgres`` extra on every
node; a SQLite path only when every node sees the same file). Nothing here is a scheduler of our own:
Ray places the actors (``num_cpus``, ``resources``), and the store's task queue hands out the work, so
actors can be added, lost or restarted at any time (a lost actor's lease expires and its try is
retried)::

    import ray
    from lightning_rl.trainer_bridge.ray_runners import start_ray_runners

    ray.init(address="auto")
    runners = start_ray_runners("my_pkg.agents:solve", ["http://store-a:8765", "http://store-b:8765"], n=16,
                                concurrency=8)
    ...                                   # enqueue tasks; trajectories appear in the store
    stop_ray_runners(runners)             # finish the tries in hand, then exit

Ray is imported only when these functions are called (it is not a dependency of lightning-rl).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from ..settings import ENV_STORE_TOKEN, store_token


class _RunnerActor:
    """The actor body (wrapped by ``ray.remote`` in :func:`start_ray_runners`)."""

    def __init__(self, agent: str, store_url: str, token: str | None, options: dict) -> None:
        if token:
            os.environ[ENV_STORE_TOKEN] = token
        from .._api import configure
        from .agent_loading import load_agent
        from .runner import Runner

        self.store = configure(store=store_url)
        self.runner = Runner(self.store, load_agent(agent), **options)

    def serve(self, idle_exit: float | None, max_rollouts: int | None) -> dict:
        from .._api import stats

        ran = self.runner.serve(idle_exit=idle_exit, max_rollouts=max_rollouts)
        self.store.flush()
        return {"runner": self.runner.runner_id, "ran": ran, "node": os.uname().nodename, "counters": stats()}

    def stop(self) -> None:
        self.runner.stop()


@dataclass
class RayRunners:
    actors: list[Any]
    results: list[Any]  # ObjectRefs of each actor's serve(): {"runner", "ran", "node", "counters"}


def start_ray_runners(agent: str, store_url: str | Sequence[str], *, n: int = 2, concurrency: int = 8,
                      lease_seconds: float = 60.0, rollout_timeout: float | None = 120.0, idle_exit: float | None = None,
                      max_rollouts: int | None = None, token: str | None = None, num_cpus: float = 1,
                      resources: dict[str, float] | None = None, runtime_env: dict | None = None) -> RayRunners:
    """Start ``n`` runner actors on the connected Ray cluster; each serves the queue until stopped,
    idle for ``idle_exit`` seconds, or done with ``max_rollouts`` tries. ``store_url``: a store URL, or a
    list of store servers' URLs (the actors fail over between them)."""
    try:
        import ray
    except ImportError:
        raise ConfigurationError("Ray runners need ray (pip install ray); or start runner processes with "
                                 "`lightning-rl runner`") from None
    if ":" not in agent:
        raise ConfigurationError(f"agent {agent!r} is not module:function (Ray actors import it by name)")
    if not ray.is_initialized():
        raise ConfigurationError("Ray is not initialized; call ray.init(address=...) first")
    actor_cls = ray.remote(_RunnerActor).options(num_cpus=num_cpus, resources=resources or {}, max_concurrency=2,
                                                  runtime_env=runtime_env)
    options = dict(concurrency=concurrency, lease_seconds=lease_seconds, rollout_timeout=rollout_timeout)
    token = token if token is not None else store_token()
    if not isinstance(store_url, str):
        store_url = ",".join(store_url)  # what open_store takes: comma-separated servers
    actors = [actor_cls.remote(agent, store_url, token, dict(options, runner_id=f"ray-{i}")) for i in range(n)]
    return RayRunners(actors, [a.serve.remote(idle_exit, max_rollouts) for a in actors])


def stop_ray_runners(runners: RayRunners, timeout: float | None = 300) -> list[dict]:
    """Ask every actor to stop leasing, wait for the tries in hand, and return their reports."""
    import ray

    ray.get([a.stop.remote() for a in runners.actors], timeout=timeout)
    reports = ray.get(runners.results, timeout=timeout)
    for actor in runners.actors:
        ray.kill(actor)
    return reports
