"""The sandbox contract, run against every backend that works here (``bwrap``: bubblewrap, which ``make all``
installs; ``local``: no isolation, so only what it promises), escape attempts included."""

from __future__ import annotations

import os
import socket
import time
import uuid
import weakref
from pathlib import Path

import pytest

from lightning_rl.diagnostics import counters
from lightning_rl.errors import ConfigurationError, UnknownNameError
from lightning_rl.sandbox import Limits, SandboxError, bwrap_available, open_sandbox

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["bwrap", "local"])
def backend(request):
    if request.param == "bwrap":
        missing = bwrap_available()
        assert missing is None, missing  # make all installs bubblewrap: a machine without it fails, never skips
    return request.param


def _leftovers(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(entry.name)
        except OSError:
            pass
    return found


def test_a_command_runs_with_its_input_environment_and_folder(backend, tmp_path, monkeypatch):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "note.txt").write_text("from the task\n")
    monkeypatch.setenv("LIGHTNING_RL_STORE_TOKEN", "host-secret")
    with open_sandbox(backend, tmp_path / "task") as box:
        done = box.run(["sh", "-c", 'cat note.txt; read line; echo "got $line"; echo "[$LIGHTNING_RL_STORE_TOKEN]";'
                        ' echo "$GREETING"; echo oops >&2; exit 3'], stdin="hello\n", env={"GREETING": "hi"})
        assert (done.exit_code, done.ended, done.ok) == (3, "exit", False)
        assert done.stdout == "from the task\ngot hello\n[]\nhi\n" and done.stderr == "oops\n"  # a clean environment
        assert box.run(["true"]).ok and box.run(["sh", "-c", "echo x > made.txt"]).ok
        assert box.get("made.txt") == b"x\n"
        box.put("sub/given.txt", "put there")
        assert box.run(["cat", "sub/given.txt"]).stdout == "put there"
        assert box.alive()
    assert not box.alive() and not box.folder.exists()  # closed: nothing left behind
    assert sorted(p.name for p in (tmp_path / "task").iterdir()) == ["note.txt"]  # the try wrote into its copy only


def test_two_sandboxes_of_one_task_never_see_each_others_files(backend, tmp_path):
    with open_sandbox(backend, tmp_path) as a, open_sandbox(backend, tmp_path) as b:
        assert a.run(["sh", "-c", "echo mine > only_a.txt"]).ok
        assert b.run(["ls"]).stdout == ""


def test_the_deadline_ends_the_command(backend):
    with open_sandbox(backend) as box:
        done = box.run(["sh", "-c", "trap '' TERM; sleep 30"], timeout=1.0)
        assert (done.ended, done.exit_code) == ("deadline", None) and done.duration < 25


def test_output_past_the_limit_is_counted_not_kept(backend):
    with open_sandbox(backend, limits=Limits(output_bytes=1000)) as box:
        done = box.run(["sh", "-c", "head -c 500000 /dev/zero | tr '\\0' a"])
        assert done.ok and len(done.stdout) == 1000 and done.truncated_bytes == 499000
    assert counters().get("sandbox_output_cut_bytes", 0) >= 499000  # counted for the metrics line too


def test_a_memory_hog_hits_its_limit(backend):
    with open_sandbox(backend, limits=Limits(memory_mb=256)) as box:
        done = box.run(["python3", "-c", "x = bytearray(1 << 30); x[::4096] = b'x' * len(x[::4096]); print('kept')"],
                       timeout=60)
        # an address-space limit raises MemoryError; a control group's limit (bwrap as root) kills it (137: SIGKILL)
        assert "kept" not in done.stdout and ("MemoryError" in done.stderr or done.exit_code == 137), done


def test_bad_input_is_one_clear_error(backend, tmp_path):
    with pytest.raises(ConfigurationError, match="not a readable folder"):
        open_sandbox(backend, tmp_path / "missing")
    with open_sandbox(backend) as box:
        with pytest.raises(ConfigurationError, match="leaves the sandbox's folder"):
            box.put("../outside.txt", "x")
        with pytest.raises(ConfigurationError, match="deadline in seconds"):
            box.run(["true"], timeout=0)
    with pytest.raises(SandboxError, match="closed"):
        box.run(["true"])
    with pytest.raises(UnknownNameError, match="bwrap.*local|local.*bwrap"):
        open_sandbox("podman-typo")
    with pytest.raises(ConfigurationError, match="memory_mb"):
        Limits(memory_mb=0)


# bwrap only: what a try must not reach


def test_a_bwrap_try_sees_no_home_no_project_no_host_tmp_and_writes_nothing_outside(tmp_path):
    assert bwrap_available() is None
    marker = tmp_path / "host-file"
    marker.write_text("host")
    host_tmp = Path("/tmp") / f"lrl-host-{uuid.uuid4().hex}"
    host_tmp.write_text("host tmp")
    try:
        with open_sandbox("bwrap") as box:
            for path in (os.path.expanduser("~"), str(ROOT), str(marker), str(host_tmp), "/etc/ssh"):
                done = box.run(["sh", "-c", f"cat {path}/* {path} 2>/dev/null | head -c 100"])
                assert done.stdout == "", (path, done.stdout)
            assert box.run(["cat", "/etc/shadow"]).stdout == ""
            for target in ("/usr/escape.txt", "/etc/escape.txt", str(tmp_path / "escape.txt")):
                assert not box.run(["sh", "-c", f"echo x > {target}"]).ok
            assert not (tmp_path / "escape.txt").exists()
            assert box.run(["hostname"]).stdout.strip() == "sandbox"
    finally:
        host_tmp.unlink()


def test_a_bwrap_try_reaches_no_network_not_even_the_hosts_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with open_sandbox("bwrap") as box:
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)"
            done = box.run(["python3", "-c", probe], timeout=30)
            assert done.exit_code != 0 and ("ConnectionRefused" in done.stderr or "unreachable" in done.stderr)


def test_at_the_deadline_nothing_of_a_bwrap_try_is_left_running():
    """A command that ignores SIGTERM and leaves a double-forked daemon behind: all of it ends at the deadline."""
    marker = f"{time.time() % 1000:.6f}".replace(".", "")  # sleep takes it as a number of seconds
    with open_sandbox("bwrap") as box:
        script = f"trap '' TERM; (setsid sh -c 'sleep 9{marker}' &); sleep 8{marker}"
        done = box.run(["sh", "-c", script], timeout=2.0)
        assert done.ended == "deadline"
    deadline = time.monotonic() + 10
    while _leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(marker) == []


def test_a_sandbox_commands_child_execs_without_reopening_the_stores(tmp_path, monkeypatch):
    """Python runs the after-fork hooks in a Popen child with a preexec_fn, and the stores' hook re-opened SQLite
    connections there, between fork and exec: a child that deadlocked on SQLite's allocator mutex, held by another
    thread at the fork (seen in gdb: run_at_forkers -> pysqlite_connection_init -> sqlite3Malloc -> futex). A sandbox
    command's child re-opens nothing; a plain fork's child still re-opens the stores it inherits."""
    from lightning_rl.store import lifecycle

    reopened = tmp_path / "reopened"

    class Store:  # what lifecycle.track() keeps: its _after_fork is called in forked children
        _closed = False

        def _after_fork(self) -> None:
            fd = os.open(reopened, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.close(fd)

        def close(self) -> None:
            self._closed = True

    store = Store()
    # only this store is re-opened in the forked child (not the worker's real ones: their re-open is what can hang)
    monkeypatch.setattr(lifecycle, "_open", weakref.WeakSet())
    lifecycle.track(store)
    try:
        with open_sandbox("bwrap") as box:
            assert box.run(["true"]).ok
        assert not reopened.exists()  # the sandbox command's child only set itself up and exec'd
        pid = os.fork()
        if pid == 0:  # a worker process forked from here: it uses the stores, so they are re-opened in it
            os._exit(0)
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0):  # never a test that waits forever on a stuck child
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not exit within 30 s")
            time.sleep(0.01)
        assert reopened.read_text().split() == [str(pid)]
    finally:
        store.close()
