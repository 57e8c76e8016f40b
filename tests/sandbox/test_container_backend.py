"""The sandbox contract (tests/sandbox/test_contract.py's behaviours) for the container backends, ``docker`` and
``podman``: each skipped, with the reason ``container_available`` gives, where its runtime or image is missing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.sandbox import Limits, SandboxError, open_sandbox
from lightning_rl.sandbox.backends import SANDBOX_BACKENDS
from lightning_rl.sandbox.container import ContainerSandbox, PodmanSandbox, container_available

ROOT = Path(__file__).resolve().parents[2]
_AVAILABLE: dict[str, str | None] = {}


@pytest.fixture(params=["docker", "podman"])
def backend(request):
    if request.param not in _AVAILABLE:
        _AVAILABLE[request.param] = container_available(request.param)
    if _AVAILABLE[request.param] is not None:
        pytest.skip(_AVAILABLE[request.param])
    return request.param


def _containers(cli: str, name: str) -> list[str]:
    done = subprocess.run([cli, "ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}"],
                          capture_output=True, text=True, timeout=60)
    return [line for line in done.stdout.split() if line == name]


def _leftovers(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(entry.name)
        except OSError:
            pass
    return found


def test_both_names_are_registered_at_import():
    assert SANDBOX_BACKENDS.get("docker") is ContainerSandbox and SANDBOX_BACKENDS.get("podman") is PodmanSandbox
    assert PodmanSandbox.cli == "podman" and ContainerSandbox.cli == "docker"


def test_a_missing_cli_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert container_available("docker") == "docker is not installed (no docker on PATH): apt-get install docker.io"
    with pytest.raises(SandboxError, match="podman is not installed.*apt-get install podman"):
        open_sandbox("podman")


def test_a_command_runs_with_its_input_environment_and_folder(backend, tmp_path, monkeypatch):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "note.txt").write_text("from the task\n")
    monkeypatch.setenv("LIGHTNING_RL_STORE_TOKEN", "host-secret")
    with open_sandbox(backend, tmp_path / "task") as box:
        done = box.run(["sh", "-c", 'cat note.txt; read line; echo "got $line"; echo "[$LIGHTNING_RL_STORE_TOKEN]";'
                        ' echo "$GREETING"; echo oops >&2; exit 3'], stdin="hello\n", env={"GREETING": "hi"})
        assert (done.exit_code, done.ended, done.ok) == (3, "exit", False)
        assert done.stdout == "from the task\ngot hello\n[]\nhi\n" and done.stderr == "oops\n"  # a clean environment
        names = sorted(line.split("=")[0] for line in box.run(["env"]).stdout.splitlines())
        assert names == ["HOME", "LANG", "PATH"]  # nothing of the host's or the image's
        assert box.run(["true"]).ok and box.run(["sh", "-c", "echo x > made.txt"]).ok
        assert box.get("made.txt") == b"x\n"
        box.put("sub/given.txt", "put there")
        assert box.run(["cat", "sub/given.txt"]).stdout == "put there"
        assert box.run(["pwd"], cwd="/work/sub").stdout == "/work/sub\n"
        assert box.run(["sh", "-c", "exit 0"]).ok and box.alive()
        name = box.name
        assert _containers(backend, name) == [name]
    assert not box.alive() and not box.folder.exists()  # closed: the folder and the container are gone
    assert _containers(backend, name) == []
    assert sorted(p.name for p in (tmp_path / "task").iterdir()) == ["note.txt"]  # the try wrote into its copy only


def test_two_sandboxes_of_one_task_never_see_each_others_files(backend, tmp_path):
    with open_sandbox(backend, tmp_path) as a, open_sandbox(backend, tmp_path) as b:
        assert a.run(["sh", "-c", "echo mine > only_a.txt"]).ok
        assert b.run(["ls"]).stdout == ""


def test_the_deadline_ends_a_command_that_ignores_sigterm(backend):
    with open_sandbox(backend) as box:
        done = box.run(["sh", "-c", "trap '' TERM; sleep 30"], timeout=1.0)
        assert (done.ended, done.exit_code) == ("deadline", None) and done.duration < 25
        assert len(box.processes()) == 2  # init and the keeper only
        assert box.alive() and box.run(["echo", "next"]).stdout == "next\n"  # the sandbox goes on


def test_at_the_deadline_nothing_of_the_try_is_left_running(backend):
    """A command that ignores SIGTERM and leaves a double-forked daemon behind: all of it ends at the deadline."""
    marker = f"{time.time() % 1000:.6f}".replace(".", "")  # sleep takes it as a number of seconds
    with open_sandbox(backend) as box:
        script = f"trap '' TERM; (setsid sh -c 'sleep 9{marker}' &); sleep 8{marker}"
        done = box.run(["sh", "-c", script], timeout=2.0)
        assert done.ended == "deadline"
        assert len(box.processes()) == 2, box.processes()  # <cli> top: init and the keeper only
        assert _leftovers(marker) == []


def test_what_a_finished_command_left_in_the_background_ends_with_it(backend):
    marker = f"{time.time() % 1000:.6f}".replace(".", "")
    with open_sandbox(backend) as box:
        done = box.run(["sh", "-c", f"(setsid sh -c 'sleep 7{marker}' &); echo started"], timeout=10)
        assert done.ok and done.stdout == "started\n"
        assert len(box.processes()) == 2 and _leftovers(marker) == []


def test_output_past_the_limit_is_counted_not_kept(backend):
    with open_sandbox(backend, limits=Limits(output_bytes=1000)) as box:
        done = box.run(["sh", "-c", "head -c 500000 /dev/zero | tr '\\0' a"])
        assert done.ok and len(done.stdout) == 1000 and done.truncated_bytes == 499000


def test_a_memory_hog_hits_its_limit(backend):
    with open_sandbox(backend, limits=Limits(memory_mb=256)) as box:
        done = box.run(["python3", "-c", "x = bytearray(1 << 30)"], timeout=60)
        assert done.exit_code != 0 and "MemoryError" in done.stderr
        assert box.run(["sh", "-c", "ulimit -v"]).stdout == f"{256 << 10}\n"


def test_the_container_holds_the_whole_try_to_its_memory(backend):
    """Three processes, each within the per-process limit, together past the container's: the kernel kills."""
    hog = "x = bytearray(150 << 20); import time; time.sleep(5)"
    with open_sandbox(backend, limits=Limits(memory_mb=256)) as box:
        done = box.run(["sh", "-c", f'for i in 1 2 3; do python3 -c "{hog}" & done; fails=0; '
                        'for j in 1 2 3; do wait %$j || fails=$((fails+1)); done; echo $fails'], timeout=60)
        assert done.ok and int(done.stdout) >= 1, done


def test_bad_input_is_one_clear_error(backend, tmp_path):
    with pytest.raises(ConfigurationError, match="not a readable folder"):
        open_sandbox(backend, tmp_path / "missing")
    with open_sandbox(backend) as box:
        with pytest.raises(ConfigurationError, match="leaves the sandbox's folder"):
            box.put("../outside.txt", "x")
        with pytest.raises(ConfigurationError, match="deadline in seconds"):
            box.run(["true"], timeout=0)
        with pytest.raises(ConfigurationError, match="argv is empty"):
            box.run([])
    with pytest.raises(SandboxError, match="closed"):
        box.run(["true"])
    with pytest.raises(SandboxError, match="could not start its container"):
        open_sandbox(backend, image=f"lrl-no-such-image-{uuid.uuid4().hex}:x")


def test_a_try_sees_no_home_no_project_no_host_tmp_and_writes_nothing_outside(backend, tmp_path):
    marker = tmp_path / "host-file"
    marker.write_text("host")
    host_tmp = Path("/tmp") / f"lrl-host-{uuid.uuid4().hex}"
    host_tmp.write_text("host tmp")
    try:
        with open_sandbox(backend) as box:
            for path in (os.path.expanduser("~"), str(ROOT), str(marker), str(host_tmp), "/etc/ssh"):
                done = box.run(["sh", "-c", f"cat {path}/* {path} 2>/dev/null | head -c 100"])
                assert done.stdout == "", (path, done.stdout)
            assert "host-secret" not in box.run(["cat", "/etc/shadow"]).stdout  # the image's own, if any
            for target in ("/usr/escape.txt", "/etc/escape.txt", str(tmp_path / "escape.txt")):
                assert not box.run(["sh", "-c", f"echo x > {target}"]).ok
            assert not (tmp_path / "escape.txt").exists()
            assert box.run(["hostname"]).stdout.strip() == "sandbox"
            assert box.run(["sh", "-c", "grep CapEff /proc/self/status"]).stdout.split()[-1] == "0000000000000000"
            assert box.run(["sh", "-c", "echo t > /tmp/t && cat /tmp/t"]).stdout == "t\n"  # a private /tmp
    finally:
        host_tmp.unlink()


def test_a_try_reaches_no_network_not_even_the_hosts_loopback(backend):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with open_sandbox(backend) as box:
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"
            done = box.run(["python3", "-c", probe], timeout=30)
            assert done.exit_code != 0 and ("ConnectionRefused" in done.stderr or "unreachable" in done.stderr)
            assert box.run(["sh", "-c", "ls /sys/class/net"]).stdout.split() == ["lo"]


def test_a_replaced_folder_is_mounted_again(backend):
    """A reset replaces the try's folder; a bind mount would keep the old one, so the container is made again."""
    with open_sandbox(backend) as box:
        assert box.run(["sh", "-c", "echo old > f.txt"]).ok
        shutil.rmtree(box.folder)
        box.folder.mkdir()
        box.put("g.txt", "new")
        assert box.run(["ls"]).stdout == "g.txt\n"


def test_a_try_that_kills_its_keeper_breaks_only_its_own_sandbox(backend):
    with open_sandbox(backend) as box:
        try:
            box.run(["sh", "-c", "kill -9 -1"], timeout=10)  # may already say the container is gone
        except SandboxError:
            pass
        with pytest.raises(SandboxError, match="container is gone"):
            box.run(["true"])
        assert not box.alive()
        name = box.name
    assert _containers(backend, name) == [] and not box.folder.exists()

