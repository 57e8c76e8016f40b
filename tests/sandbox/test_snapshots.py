"""Snapshots (a task prepared once) and the copy-on-write views tries get of them: writes never reach the snapshot
or the next try, reset forgets them, restore puts protected files back; the kernel's limits on a whole try."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.sandbox import Limits, SandboxError, Snapshot, open_sandbox, overlay_available
from lightning_rl.sandbox.cgroups import cgroups_missing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["bwrap", "local"])
def backend(request):
    return request.param


@pytest.fixture
def task(tmp_path):
    folder = tmp_path / "task"
    (folder / "tests").mkdir(parents=True)
    (folder / "tests" / "test_calc.py").write_text("assert add(1, 2) == 3\n")
    (folder / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    return folder


def test_overlays_mount_here():
    assert overlay_available() is None  # this machine (and CI) must give tries copy-on-write views


def test_every_try_starts_from_the_snapshot_and_its_writes_reach_nothing_else(backend, task):
    with Snapshot(task, setup=["sh", "-c", "echo installed > deps.txt"]) as snap:
        assert (snap.path / "deps.txt").read_text() == "installed\n" and snap.files == 2
        with open_sandbox(backend, snapshot=snap) as a, open_sandbox(backend, snapshot=snap) as b:
            assert a.run(["cat", "deps.txt"]).stdout == "installed\n"
            assert a.run(["sh", "-c", "echo 'return a + b' >> calc.py; rm -r tests; echo new > made.txt"]).ok
            assert a.get("made.txt") == b"new\n" and b"a + b" in a.get("calc.py")
            with pytest.raises(FileNotFoundError):
                a.get("tests/test_calc.py")
            assert b.run(["ls"]).stdout.split() == ["calc.py", "deps.txt", "tests"]  # the other try: untouched
            assert b.get("calc.py") == (task / "calc.py").read_bytes()
            took = a.reset()
            assert took < 5 and a.run(["ls"]).stdout.split() == ["calc.py", "deps.txt", "tests"]
        assert sorted(p.name for p in snap.path.iterdir()) == ["calc.py", "deps.txt", "tests"]
        assert (snap.path / "calc.py").read_text() == (task / "calc.py").read_text()
    assert not snap.path.exists()


def test_restore_puts_back_what_the_try_must_not_change(backend, task):
    with Snapshot(task) as snap, open_sandbox(backend, snapshot=snap) as box:
        box.run(["sh", "-c", "echo 'assert True' > tests/test_calc.py; echo mine > tests/extra.py"])
        assert box.restore(["tests/test_calc.py", "calc.py"]) == ["tests/test_calc.py"]
        assert box.get("tests/test_calc.py") == b"assert add(1, 2) == 3\n"
        assert box.get("tests/extra.py") == b"mine\n"  # only what was named comes back
        box.run(["sh", "-c", "rm -rf tests && mkdir tests && echo 'assert True' > tests/test_calc.py"])
        assert box.restore(["tests"]) == ["tests"]
        assert box.run(["ls", "tests"]).stdout.split() == ["test_calc.py"]
        assert box.run(["cat", "tests/test_calc.py"]).stdout == "assert add(1, 2) == 3\n"
        box.run(["rm", "-rf", "tests"])
        assert box.restore(["tests/test_calc.py"]) == ["tests/test_calc.py"]  # under a folder the try deleted
        assert box.run(["cat", "tests/test_calc.py"]).stdout == "assert add(1, 2) == 3\n"


def test_files_and_folders_go_in_and_out_as_the_try_sees_them(backend, task, tmp_path):
    with Snapshot(task) as snap, open_sandbox(backend, snapshot=snap) as box:
        box.run(["sh", "-c", "rm tests/test_calc.py; echo b > tests/b.py; mkdir -p out/deep; echo x > out/deep/x"])
        box.put("given/one.txt", "1")
        box.get_folder(".", tmp_path / "seen")
        seen = sorted(str(p.relative_to(tmp_path / "seen")) for p in (tmp_path / "seen").rglob("*") if p.is_file())
        assert seen == ["calc.py", "given/one.txt", "out/deep/x", "tests/b.py"]
        assert box.run(["cat", "given/one.txt"]).stdout == "1"
        with pytest.raises(ConfigurationError, match="leaves the sandbox's folder"):
            box.get("../../etc/passwd")


def test_a_try_cannot_read_host_files_through_a_symlink_it_made(task):
    with Snapshot(task) as snap, open_sandbox("bwrap", snapshot=snap) as box:
        assert box.run(["ln", "-s", "/root/.ssh/id_rsa", "key"]).ok
        with pytest.raises(ConfigurationError, match="symlink"):
            box.get("key")


def test_a_task_folder_too_big_or_missing_and_a_failing_setup_are_refused(tmp_path, task, monkeypatch):
    own = tmp_path / "tmp"  # this test's snapshots only: another test file's, beside it in /tmp, are not leftovers
    own.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    for i in range(5):
        (tmp_path / "many").mkdir(exist_ok=True)
        (tmp_path / "many" / f"f{i}").write_text("x")
    with pytest.raises(ConfigurationError, match="more than 3 files.*max_files"):
        Snapshot(tmp_path / "many", max_files=3)
    with pytest.raises(ConfigurationError, match="not a readable folder"):
        Snapshot(tmp_path / "nowhere")
    with pytest.raises(SandboxError, match="setup .* ended .*exit code 3.*broken"):
        Snapshot(task, setup=["sh", "-c", "echo broken >&2; exit 3"])
    with pytest.raises(SandboxError, match="ran past its deadline of 1 s"):
        Snapshot(task, setup=["sleep", "30"], setup_timeout=1)
    assert not list(own.glob("lrl-snapshot-*"))  # nothing left of them


def test_a_fork_storm_stops_at_the_process_limit_and_the_host_goes_on():
    if cgroups_missing() is not None and os.getuid() == 0:
        # without a control group nothing holds root's processes: the storm would fill the host's process table
        pytest.skip(f"not run as root without control groups: {cgroups_missing()}")
    storm = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    with open_sandbox("bwrap", limits=Limits(processes=32)) as box:
        many = box.run(["sh", "-c", "for i in $(seq 100); do sleep 3 & done; wait"], timeout=30)
        assert many.exit_code != 0 and "fork" in many.stderr.lower()
        assert box.run(["python3", "-c", storm], timeout=3).ended == "deadline"
        assert box.run(["true"]).ok
    assert subprocess.run(["true"]).returncode == 0


def test_writes_past_the_disk_limit_are_stopped_or_reported():
    with open_sandbox("bwrap", limits=Limits(disk_mb=8)) as box:
        assert box.run(["sh", "-c", "head -c 20000000 /dev/zero > big"]).ended == "disk"
        tmp = box.run(["sh", "-c", "head -c 20000000 /dev/zero > /tmp/big"])
        assert tmp.exit_code != 0 and "No space left" in tmp.stderr


def test_nothing_is_left_mounted_and_no_control_group_remains(task, monkeypatch):
    """This test's own groups (other tests' sandboxes may run at the same time, in other workers)."""
    from lightning_rl.sandbox import cgroups

    made: list[Path] = []
    real = cgroups.RunGroup.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.extend(self.folders)

    monkeypatch.setattr(cgroups.RunGroup, "__init__", recording)
    with Snapshot(task) as snap:
        for _ in range(3):
            with open_sandbox("bwrap", snapshot=snap, limits=Limits(cpus=0.5)) as box:
                assert box.run(["sh", "-c", "sleep 0.1 & true"]).ok  # a process left behind by the command
    assert "lrl-sandbox" not in Path("/proc/mounts").read_text()  # the overlays lived in the runs' namespaces
    assert not [folder for folder in made if folder.exists()]
    assert len(made) == (9 if cgroups_missing() is None else len(made))  # pids, memory, cpu; three runs (here: root)


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="drops from root to nobody")
def test_an_unprivileged_user_gets_the_same_copy_on_write_views(tmp_path):
    """The overlay in a user namespace of its own (``userxattr``): what a non-root trainer's tries get."""
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"lrl-nobody-{os.getpid()}"
    (home / "task").mkdir(parents=True)
    (home / "task" / "a.txt").write_text("snapshot\n")
    shutil.chown(home, "nobody")
    shutil.chown(home / "task", "nobody")
    shutil.chown(home / "task" / "a.txt", "nobody")
    script = textwrap.dedent("""
        import sys
        from lightning_rl.sandbox import Snapshot, open_sandbox, overlay_available
        assert overlay_available() is None, overlay_available()
        with Snapshot(sys.argv[1]) as snap, open_sandbox("bwrap", snapshot=snap) as box:
            assert box.layers is not None
            assert box.run(["sh", "-c", "cat a.txt; rm a.txt; echo b > b.txt"]).stdout == "snapshot\\n"
            try:
                box.get("a.txt")
                raise SystemExit("a deleted file was still seen")
            except FileNotFoundError:
                pass
            assert box.restore(["a.txt"]) == ["a.txt"] and box.run(["cat", "a.txt"]).stdout == "snapshot\\n"
            assert (snap.path / "a.txt").read_text() == "snapshot\\n"
        print("ok")
    """)
    try:
        done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
                               "-c", script, str(home / "task")], capture_output=True, text=True, timeout=120,
                              cwd=ROOT, env={**os.environ, "TMPDIR": str(home), "HOME": str(home)})
        assert done.stdout.strip() == "ok", done.stderr[-2000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)
