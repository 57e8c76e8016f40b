"""The store's token reaches verl's Ray workers on a cluster started elsewhere (``ray start`` in another shell,
as on a multi-node run): ``verl_main`` runs verl's TaskRunnerV1 as an actor whose runtime environment carries
the launching shell's ``LIGHTNING_RL_*``, and actors it starts (verl's agent-loop workers, with runtime
environments of their own) have them too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

pytestmark = [pytest.mark.ray, pytest.mark.verl]


@pytest.fixture
def cluster():
    """A Ray head started by `ray start`, in an environment without the token (another shell)."""
    temp = Path(f"/tmp/lrl-ray-{uuid.uuid4().hex[:8]}")  # short: Ray's socket paths have a length limit
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_RL_")}
    port = 30000 + int(uuid.uuid4().hex[:4], 16) % 20000
    ray_bin = str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    f"--temp-dir={temp}", "--disable-usage-stats"], env=env, check=True, capture_output=True,
                   timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        ray.shutdown()
        # `ray stop` would stop every Ray of this user: only this cluster's processes go
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and str(temp).encode() in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass  # gone meanwhile
        shutil.rmtree(temp, ignore_errors=True)


def _child_env(_runner, key):
    """From inside the task runner: start an actor with a runtime environment of its own (as verl starts its
    agent-loop workers and vLLM servers) and read ``key`` in it."""
    import os

    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def env(self, name):
            return os.environ.get(name), os.environ.get("VERL_LIKE")

    worker = Worker.options(runtime_env={"env_vars": {"VERL_LIKE": "1"}}).remote()
    return ray.get(worker.env.remote(key)), os.environ.get(key)


def test_the_store_token_reaches_the_workers_verls_task_runner_starts(cluster, monkeypatch):
    from lightning_rl.trainer_bridge.verl_main import task_runner, worker_env

    monkeypatch.setenv("LIGHTNING_RL_STORE_TOKEN", "s3cret-token")
    ray.init(address=cluster, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Plain:  # the defect: an actor started on that cluster without a runtime environment
        def env(self):
            return os.environ.get("LIGHTNING_RL_STORE_TOKEN")

    assert ray.get(Plain.remote().env.remote()) is None  # the cluster's workers never saw the shell's token

    env = worker_env()
    assert env["LIGHTNING_RL_STORE_TOKEN"] == "s3cret-token" and env["PYTHONPATH"].split(os.pathsep)[0] == os.getcwd()
    runner = task_runner(env).remote()  # verl's TaskRunnerV1 (ours), as verl_main hands it to run_ppo
    (in_child, verl_like), in_runner = ray.get(runner.__ray_call__.remote(_child_env, "LIGHTNING_RL_STORE_TOKEN"))
    assert in_runner == in_child == "s3cret-token" and verl_like == "1"
    ray.kill(runner)
