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


def _child_secret(_runner):
    """From inside the task runner: an actor of its own reads the store's token as lightning-rl reads it."""
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def token(self):
            from lightning_rl.settings import store_token

            return store_token()

    return ray.get(Worker.options(runtime_env={"env_vars": {"VERL_LIKE": "1"}}).remote().token.remote())


def test_the_store_token_reaches_the_workers_verls_task_runner_starts(cluster, monkeypatch, tmp_path):
    from lightning_rl.trainer_bridge.verl.main import secrets_env, task_runner, worker_env

    monkeypatch.setenv("LIGHTNING_RL_STORE_TOKEN", "s3cret-token")
    monkeypatch.setenv("LIGHTNING_RL_AGENTS", "solver")
    ray.init(address=cluster, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Plain:  # the defect: an actor started on that cluster without a runtime environment
        def env(self):
            return os.environ.get("LIGHTNING_RL_STORE_TOKEN")

    assert ray.get(Plain.remote().env.remote()) is None  # the cluster's workers never saw the shell's token

    env = worker_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.getcwd() and env["LIGHTNING_RL_AGENTS"] == "solver"
    assert "LIGHTNING_RL_STORE_TOKEN" not in env  # Ray logs runtime environments: never the secret itself
    with secrets_env() as secret:
        (path,) = secret.values()
        assert oct(os.stat(path).st_mode & 0o777) == "0o600" and "s3cret-token" in Path(path).read_text()
        runner = task_runner({**env, **secret}).remote()  # verl's TaskRunnerV1 (ours), as verl.main hands it
        (in_child, verl_like), in_runner = ray.get(runner.__ray_call__.remote(_child_env, "LIGHTNING_RL_AGENTS"))
        assert in_runner == in_child == "solver" and verl_like == "1"
        assert ray.get(runner.__ray_call__.remote(_child_secret)) == "s3cret-token"
        ray.kill(runner)
    assert not Path(path).exists()  # removed when the run ends
    logs = [p for p in Path(ray._private.worker._global_node.get_session_dir_path()).rglob("*.log")]
    assert logs and not [p for p in logs if "s3cret-token" in p.read_text(errors="replace")]


def test_a_run_on_several_nodes_needs_a_shared_folder_for_the_secrets(monkeypatch, tmp_path):
    from lightning_rl.errors import ConfigurationError
    from lightning_rl.trainer_bridge.verl.main import secrets_env

    monkeypatch.setenv("LIGHTNING_RL_STORE", "postgresql://lrl:pw@db/lrl")
    monkeypatch.delenv("LIGHTNING_RL_SECRETS_DIR", raising=False)
    with pytest.raises(ConfigurationError, match="LIGHTNING_RL_SECRETS_DIR"):
        with secrets_env(nodes=2):
            pass
    monkeypatch.setenv("LIGHTNING_RL_SECRETS_DIR", str(tmp_path))
    with secrets_env(nodes=2) as secret:
        assert Path(secret["LIGHTNING_RL_SECRETS_FILE"]).parent.parent == tmp_path


def test_the_secrets_of_a_killed_launch_are_swept_by_the_next(tmp_path):
    """kill -9 of ``train verl`` never reaches the launcher's ``finally``: the next launch removes the secrets
    folder of a launcher that is gone, never one of a launcher still running."""
    from lightning_rl.trainer_bridge.verl.main import sweep_secrets

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"lightning-rl-verl-{done.stdout.strip()}-abc"
    alive = tmp_path / f"lightning-rl-verl-{os.getpid()}-def"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "secrets.json").write_text('{"LIGHTNING_RL_STORE": "postgresql://u:pw@db/x"}')
    assert sweep_secrets(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists()
