"""The coding-fix task family (examples/coding_fix/tasks.py, issue 56's first part): deterministic, every kind
verified in a sandbox (tests fail as generated, pass with the fix), splits that share no task, a task whose tests
pass before any edit refused, and a try that edits the tests gains nothing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from lightning_rl.sandbox import Snapshot, open_sandbox

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "coding_fix"))  # tasks, tools
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


def test_the_tools_run_in_each_trys_sandbox_and_the_harness_scores_with_the_tests_restored(traced, tmp_path):
    """Scripted agents (no model: the plumbing is under test): one applies the fix through the tools, one empties the
    tests, one does nothing. Each tool is a tool span; the reward is the task's own tests after the agent."""
    import lightning_rl as lrl
    from lightning_rl.sandbox.pool import PoolPerTask
    from lightning_rl.trainer_bridge.runner import Runner

    import tools  # examples/coding_fix/tools.py

    made = {s: family.generate(s) for s in (1, 2)}

    def folder_of(task):  # PoolPerTask calls it under its lock: writing here never races a snapshot's copy
        return task["seed"], made[task["seed"]].write(tmp_path / f"task{task['seed']}")

    @lrl.trace
    def agent(task):
        fix = made[task["seed"]].fix
        assert tools.run_tests(call_id="c1").startswith("FAILED")
        assert f"{fix[1]}: " in tools.read_file(fix[0], call_id="c2")
        if task["how"] == "fix":
            bad = made[task["seed"]].files[fix[0]].split("\n")[fix[1] - 1]
            assert tools.call("replace", {"path": fix[0], "line": fix[1], "old": "x" * 50, "new": ""}).startswith(
                "error: 'xxxx")  # not in the line: told, nothing changed
            assert tools.call("replace", {"path": fix[0], "line": fix[1], "old": bad.strip(),
                                          "new": fix[2].strip()}).startswith("ok")
            assert tools.run_tests().startswith("PASSED")
        elif task["how"] == "cheat":
            assert tools.call("edit_line", {"path": "tests/test_pkg.py", "line": 1, "text": "raise SystemExit(0)"})
            assert tools.run_tests().startswith("PASSED")  # the emptied tests pass, in the try's sandbox
        assert tools.call("nope", {}).startswith("error: no tool") and tools.read_file("../x").startswith("error")

    groups = {(s, how): traced.enqueue({"seed": s, "how": how}, n=2)[0].group_id
              for s in (1, 2) for how in ("fix", "cheat", "nothing")}
    pools = PoolPerTask(folder_of, size=2)
    try:
        Runner(traced, agent, concurrency=3, sandboxes=pools, score=tools.score,
               protect=list(family.Task.protected)).run_until_done(list(groups.values()))
    finally:
        pools.close()
    for (seed, how), group in groups.items():
        for entry in traced.queue_entries([group]):
            rollout = traced.get_rollout(entry.rollout_id)
            assert entry.outcome == rollout.status == "succeeded", rollout.error
            (reward,) = traced.rewards(entry.rollout_id)
            assert reward.value == (1.0 if how == "fix" else 0.0), (seed, how)
    names = {s.name for s in traced.spans(traced.queue_entries([groups[(1, "fix")]])[0].rollout_id)}
    assert {"execute_tool run_tests", "execute_tool read_file", "execute_tool replace"} <= names
    assert (tmp_path / "task1" / family.generate(1).fix[0]).read_text() == family.generate(1).files[family.generate(1).fix[0]]


def test_run_tests_answers_the_same_in_a_sandbox_as_in_the_warm_start_batch(tmp_path):
    """The tiny coding model learns from ``traces.run_batch``'s answers; the agent sees the sandbox's. Equal, for each
    readable kind, for a wrong edit, and for an edit that leaves a module that does not import."""
    import tools
    import traces

    folders = []
    for i, kind in enumerate(traces.READABLE_KINDS):
        task = family.generate(i, kind=kind, difficulty=0)
        folders.append(task.write(tmp_path / f"{kind}"))
        wrong = task.write(tmp_path / f"{kind}-wrong")
        path, line, _ = task.fix
        lines = (wrong / path).read_text().split("\n")
        old, new = traces.wrong_edits(task)[0]
        lines[line - 1] = lines[line - 1].replace(old, new) if i else lines[line - 1].rstrip(")")  # 0: a syntax error
        (wrong / path).write_text("\n".join(lines))
        folders.append(wrong)
    batch = traces.run_batch(folders)
    for folder in folders:
        with Snapshot(folder) as snap, open_sandbox("bwrap", snapshot=snap) as box:
            done = box.run(family.test_command(), timeout=60)
        real = tools.summarize(done.ok, done.stderr + done.stdout)
        assert tools.summarize(*batch[str(folder)]) == real, folder
        assert real.startswith("FAILED") and ("pkg/" in real or "tests/test_pkg.py" in real), real
    assert "SyntaxError" in tools.summarize(*batch[str(folders[1])])


def test_warm_start_conversations_follow_the_agent_and_only_the_fix_passes():
    import agent
    import tools
    import traces

    conversations = traces.conversations(60, seed=3, right_fraction=0.3)
    names = [[c["function"]["name"] for m in conv if m["role"] == "assistant" for c in m.get("tool_calls", [])]
             for conv in conversations]
    assert all(n == ["run_tests", "read_file", "replace", "run_tests"] for n in names)
    assert all(conv[0]["content"] == agent.SYSTEM and conv[-1]["content"] == "done" for conv in conversations)
    passed = [conv[-2]["content"].startswith("PASSED") for conv in conversations]
    assert 0.1 < sum(passed) / len(passed) < 0.5  # about right_fraction: every wrong edit fails
    for conv in conversations:  # what the tools answer is what they would: the file with line numbers, the tests
        assert conv[5]["content"].startswith('1: """Part of the package."""') and conv[3]["content"].startswith("FAILED")
    for kind in traces.READABLE_KINDS:  # the right edit, applied to the bad line, is the fix; no wrong one is
        task = family.generate(4, kind=kind, difficulty=0)
        path, line, good = task.fix
        bad = task.files[path].split("\n")[line - 1]
        old, new = traces.right_edit(task)
        assert bad.replace(old, new, 1) == good
        assert all(bad.replace(o, n, 1) != good for o, n in traces.wrong_edits(task))
        assert len(set(traces.wrong_edits(task))) == 3
    with pytest.raises(ValueError, match="no edits for kind 'constant'"):
        traces.wrong_edits(family.generate(0, kind="constant"))
    assert tools.summarize(True, "\nRan 3 tests in 0.001s\n\nOK\n") == "PASSED: 3 tests"
