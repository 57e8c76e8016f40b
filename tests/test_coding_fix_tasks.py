"""The coding-fix task family (examples/coding_fix/tasks.py, issue 56's first part): deterministic, every kind
verified in a sandbox (tests fail as generated, pass with the fix), splits that share no task, a task whose tests
pass before any edit refused, and a try that edits the tests gains nothing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from lightning_rl.sandbox import Snapshot, open_sandbox

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "coding_fix"))
import tasks as family  # noqa: E402


def test_a_task_is_the_same_for_the_same_seed_and_differs_across_seeds():
    assert family.generate(7) == family.generate(7)
    assert len({family.generate(s).fingerprint for s in range(50)}) == 50


@pytest.mark.parametrize("kind", family.KINDS)
@pytest.mark.parametrize("difficulty", [0, 2])
def test_every_kind_fails_as_generated_and_passes_with_its_fix(kind, difficulty):
    task = family.generate(11, difficulty=difficulty, kind=kind)
    family.verify(task)  # raises when either run disagrees
    assert task.files[task.fix[0]].split("\n")[task.fix[1] - 1] != task.fix[2]  # the bug is on the fix's line
    assert task.fix[0] not in task.prompt and task.fix[2].strip() not in task.prompt  # the prompt says neither


def test_train_and_heldout_share_no_task():
    train = {family.generate(s).fingerprint for s in range(200)}
    heldout = {family.generate(s, split="heldout").fingerprint for s in range(200)}
    assert not train & heldout


def test_a_task_whose_tests_pass_before_any_edit_is_refused():
    task = family.generate(3)
    path, line, good = task.fix
    fixed = task.files[path].split("\n")
    fixed[line - 1] = good
    harmless = dataclasses.replace(task, files={**task.files, path: "\n".join(fixed)})
    with pytest.raises(ValueError, match="its tests pass as generated; refused"):
        family.verify(harmless)
    with pytest.raises(ValueError, match="split="):
        family.generate(1, split="test")


def test_a_try_that_edits_the_tests_gains_nothing(tmp_path):
    task = family.generate(5)
    with Snapshot(task.write(tmp_path / "task")) as snap, open_sandbox("bwrap", snapshot=snap) as box:
        box.run(["sh", "-c", "printf 'import unittest\\n' > tests/test_pkg.py"])  # no tests left: "passes"
        assert box.run(family.test_command()).ok
        assert box.restore(list(task.protected)) == ["tests"]
        assert not box.run(family.test_command()).ok  # the task's own tests again: still failing
