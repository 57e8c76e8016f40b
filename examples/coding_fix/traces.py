"""Synthetic conversations of the coding-fix agent (``agent.py``), for the tiny coding model's supervised warm start
(``scripts/make_tiny_model.py --family coding``): run the tests, read the file they point at, replace the wrong part
of the line, run the tests again, say done. What the tools answer in them is real: each task's tests are run (``run_batch``) before and
after the trace's edit and summarized as ``run_tests`` answers.

The warm start makes a policy that knows the format and where to look but mostly edits wrong: a trace's edit is the
fix in ``right_fraction`` of them, else one of the kind's plausible wrong edits (``wrong_edits``). Training is what
moves it to the fix. Only the kinds a reader of the line can fix without arithmetic are used (``READABLE_KINDS``):
a wrong constant or operator needs the tests' numbers worked through, beyond a model of this size."""

from __future__ import annotations

import json
import random
import re
import subprocess
import tempfile
from pathlib import Path

import tasks
import tools
from agent import SYSTEM

READABLE_KINDS = ("off_by_one", "swapped", "missing_case")

# One python3 (the sandbox's interpreter) runs many tasks' tests in turn, as ``python3 -B -m unittest -q`` does.
_BATCH = r"""
import io, json, os, sys, unittest
sys.dont_write_bytecode = True
out = {}
for folder in sys.argv[1:]:
    for name in [m for m in sys.modules if m.split(".")[0] in ("pkg", "tests")]:
        del sys.modules[name]
    os.chdir(folder)
    sys.path.insert(0, folder)
    stream = io.StringIO()
    try:
        suite = unittest.defaultTestLoader.loadTestsFromName("tests.test_pkg")
        result = unittest.TextTestRunner(stream=stream, verbosity=0).run(suite)
        out[folder] = [result.wasSuccessful(), stream.getvalue()]
    except BaseException:
        import traceback
        out[folder] = [False, traceback.format_exc()]
    sys.path.remove(folder)
json.dump(out, sys.stdout)
"""


def right_edit(task: tasks.Task) -> tuple[str, str]:
    """The fix as a ``replace``: the part of the fix's line that is wrong, and what it must become."""
    if task.kind == "off_by_one":
        return "range(1, count)", "range(1, count + 1)"
    if task.kind == "swapped":
        return "(part, total)", "(total, part)"
    if task.kind == "missing_case":  # the sign alone: ``return 3`` -> ``return -3`` with no digit to copy
        return "return ", "return -"
    raise ValueError(f"no edits for kind {task.kind!r}; the readable kinds are {READABLE_KINDS}")


def wrong_edits(task: tasks.Task) -> list[tuple[str, str]]:
    """Plausible wrong ``replace`` edits of the fix's line: what a reader might write who has not understood the
    failure (each leaves the tests failing)."""
    old, _ = right_edit(task)
    if task.kind == "off_by_one":
        return [(old, r) for r in ("range(0, count)", "range(1, count - 1)", "range(2, count + 1)")]
    if task.kind == "swapped":
        return [(old, r) for r in ("(part, part)", "(total, total)", "(part, total + 1)")]
    return [(old, r) for r in ("return +", "return 1 + ", "return 0 * ")]


def run_batch(folders: list[Path]) -> dict[str, tuple[bool, str]]:
    """Each folder's tests run (its own modules, fresh), in one ``python3``: their success and output."""
    out: dict[str, tuple[bool, str]] = {}
    for at in range(0, len(folders), 200):  # a process per 200: one process slows down as its imports pile up
        # -I: none of the caller's PYTHONPATH (a checkout's own tests/ package would shadow the task's), as in a sandbox
        done = subprocess.run(["python3", "-I", "-B", "-c", _BATCH, *map(str, folders[at:at + 200])],
                              capture_output=True, text=True, check=True, timeout=600)
        out.update({k: (v[0], v[1]) for k, v in json.loads(done.stdout).items()})
    return out


def _numbered(text: str) -> str:
    return "\n".join(f"{n}: {line}" for n, line in enumerate(text.split("\n"), 1))


def _call(name: str, arguments: dict, n: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{n}", "type": "function", "function": {
        "name": name, "arguments": json.dumps(arguments)}}]}


def conversations(count: int, *, seed: int, right_fraction: float = 0.25, difficulty: int = 0,
                  first_task_seed: int = 0) -> list[list[dict]]:
    """``count`` warm-start conversations over train tasks ``first_task_seed``.. of the readable kinds."""
    rng = random.Random(seed)
    drawn = [tasks.generate(first_task_seed + i, split="train", difficulty=difficulty,
                            kind=READABLE_KINDS[i % len(READABLE_KINDS)]) for i in range(count)]
    edits = [right_edit(task) if rng.random() < right_fraction else rng.choice(wrong_edits(task)) for task in drawn]
    with tempfile.TemporaryDirectory() as scratch:
        before, after = [], []
        for i, (task, (old, new)) in enumerate(zip(drawn, edits)):
            before.append(task.write(Path(scratch) / f"{i}-before"))
            edited = task.write(Path(scratch) / f"{i}-after")
            path, line, _ = task.fix
            lines = (edited / path).read_text().split("\n")
            lines[line - 1] = lines[line - 1].replace(old, new, 1)
            (edited / path).write_text("\n".join(lines))
            after.append(edited)
        ran = run_batch(before + after)
        out = []
        for task, (old, new), b, a in zip(drawn, edits, before, after):
            path, line, _ = task.fix
            out.append([
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt},
                _call("run_tests", {}, 0), {"role": "tool", "content": tools.summarize(*ran[str(b)])},
                _call("read_file", {"path": path}, 1), {"role": "tool", "content": _numbered(task.files[path])},
                _call("replace", {"path": path, "line": line, "old": old, "new": new}, 2),
                {"role": "tool", "content": f"ok: {path}:{line} edited"},
                _call("run_tests", {}, 3), {"role": "tool", "content": tools.summarize(*ran[str(a)])},
                {"role": "assistant", "content": "done"},
            ])
    return out
