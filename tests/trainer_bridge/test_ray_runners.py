"""Runners as Ray actors on a local Ray cluster, writing through a real store server.
Runs in .venv-verl (which has Ray) with `pytest -m ray`; skipped where Ray is not installed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import lightning_rl as lrl  # noqa: E402
from lightning_rl.records import QueueStatus, RolloutStatus  # noqa: E402
from lightning_rl.store import wait_for_groups  # noqa: E402
from lightning_rl.store.http.client import HttpStore  # noqa: E402
from lightning_rl.store.http.server import BackgroundServer  # noqa: E402
from lightning_rl.trainer_bridge.ray_runners import start_ray_runners, stop_ray_runners  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_ray_actor_runners_share_the_queue_through_the_store_server(tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "LIGHTNING_RL_SPILL_DIR": str(tmp_path / "spill")}})
    try:
        with BackgroundServer(tmp_path / "served.db", token="ray-token") as server:
            client = HttpStore(server.url, token="ray-token", spill_dir=tmp_path / "spill-test")
            groups = [client.enqueue({"spans": 5, "sleep": 0.02}, n=4)[0].group_id for _ in range(6)]
            runners = start_ray_runners("tests.store.server_agents:steps", server.url, n=2, concurrency=4,
                                        token="ray-token", num_cpus=0.5)
            assert wait_for_groups(client, groups, timeout=180)
            reports = stop_ray_runners(runners)
            entries = client.queue_entries(groups)
            assert len(entries) == 24 and all(e.status == QueueStatus.DONE and e.outcome == RolloutStatus.SUCCEEDED
                                              for e in entries)
            assert sorted(r["runner"] for r in reports) == ["ray-0", "ray-1"] and sum(r["ran"] for r in reports) == 24
            trajs = list(lrl.trajectories(client))
            assert len(trajs) == 24 and all(len(client.spans(t.rollout_id)) == 6 and t.final_reward == 1.0
                                            for t in trajs)
            client.close()
    finally:
        ray.shutdown()


def test_ray_actors_given_two_servers_move_to_the_other_when_one_stops(tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "LIGHTNING_RL_SPILL_DIR": str(tmp_path / "spill")}})
    try:
        db = tmp_path / "served.db"  # two servers of one store (over PostgreSQL on other machines: docs/fleet.md)
        two = BackgroundServer(db).__enter__()
        with BackgroundServer(db) as one:
            client = HttpStore([one.url, two.url], spill_dir=tmp_path / "spill-test")
            groups = [client.enqueue({"spans": 5, "sleep": 0.05}, n=4)[0].group_id for _ in range(6)]
            runners = start_ray_runners("tests.store.server_agents:steps", [one.url, two.url], n=2, concurrency=2,
                                        num_cpus=0.5)
            deadline = time.monotonic() + 120
            while len(client.rollouts(status="succeeded")) < 4:  # the actors are at work on the first server
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert wait_for_groups(client, groups, timeout=180)  # the first server stopped: they carried on
        reports = stop_ray_runners(runners)
        assert sum(r["ran"] for r in reports) == 24
        assert sum(r["counters"].get("store_server_failovers", 0) for r in reports) >= 1
        assert len(client.rollouts(status="succeeded")) == 24 and not list((tmp_path / "spill").glob("*.jsonl"))
        client.close()
        two.__exit__(None, None, None)
    finally:
        ray.shutdown()
