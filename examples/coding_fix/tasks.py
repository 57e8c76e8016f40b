"""The coding-fix task family (issue 56, first part): small Python packages with one planted bug and the tests that
show it, generated deterministically from a seed.

A task is a package (``pkg/``, 1-3 modules of 1-4 functions each) and ``tests/test_pkg.py`` (the standard library's
``unittest``: the system's ``python3`` in a sandbox runs it). One function carries the bug, of one of five kinds:
a wrong constant, an off-by-one range, a wrong operator, swapped arguments, a missing case. Which function, which
module, which line and the right value are drawn per task and appear nowhere in the prompt: only the tests' output
says what is wrong. ``difficulty`` (0-2) sets the files and functions, and whether the failing test names the buggy
function (0) or reaches it through a caller (2).

Train and held-out splits are drawn from disjoint seed streams and checked to share no task (``fingerprint``). Every
generated task is checked in a sandbox before it is handed out (``verify``): its tests fail as generated and pass
with the fix applied; one that does not is refused.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("constant", "off_by_one", "operator", "swapped", "missing_case")
SPLITS = {"train": 0, "heldout": 1}
_NOUNS = ("price", "score", "volume", "weight", "count", "length", "margin", "budget", "speed", "level", "stock",
          "height", "charge", "credit", "ratio", "total")
_VERBS = ("scale", "adjust", "compute", "measure", "estimate", "rate", "derive", "resolve", "settle", "shift")
_MODULES = ("core", "util", "calc", "rules", "metrics", "pricing")


@dataclass
class Task:
    """One task: its files (path -> text), the fix (path, 1-based line, the right line), and how it was drawn."""

    task_id: str
    split: str
    kind: str
    difficulty: int
    files: dict[str, str]
    fix: tuple[str, int, str]
    prompt: str
    protected: tuple[str, ...] = ("tests",)
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        """What the task is (its files), whatever its id: no two splits share one."""
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()[:16]

    def write(self, folder: str | Path, *, fixed: bool = False) -> Path:
        """The task's files under ``folder`` (with the fix applied when ``fixed``)."""
        folder = Path(folder)
        for path, text in self.files.items():
            target = folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if fixed and path == self.fix[0]:
                lines = text.split("\n")
                lines[self.fix[1] - 1] = self.fix[2]
                text = "\n".join(lines)
            target.write_text(text)
        return folder


def _function(rng: random.Random, kind: str, name: str,
              buggy: bool) -> tuple[list[str], str, int, list[tuple[str, object]]]:
    """A function's lines (buggy or not), the right version of the line a bug is planted on and that line's index in
    them, and test cases (the call, the value it must return)."""
    k, m = rng.randint(2, 9), rng.randint(3, 7)
    if kind == "constant":
        wrong = k + rng.choice([-1, 1]) * rng.randint(1, 3)
        good = f"    return value * {k} + {m}"
        bad = f"    return value * {wrong} + {m}"
        body = [f"def {name}(value):", good if not buggy else bad]
        cases = [(f"{name}({x})", x * k + m) for x in rng.sample(range(1, 40), 3)]
    elif kind == "off_by_one":
        good = f"    return sum(step * {k} for step in range(1, count + 1))"
        bad = f"    return sum(step * {k} for step in range(1, count))"
        body = [f"def {name}(count):", good if not buggy else bad]
        cases = [(f"{name}({n})", sum(s * k for s in range(1, n + 1))) for n in rng.sample(range(2, 12), 3)]
    elif kind == "operator":
        op, wrong = rng.choice([("-", "+"), ("*", "+"), ("+", "-"), ("//", "*")])
        good = f"    return (first {op} second) + {m}"
        bad = f"    return (first {wrong} second) + {m}"
        body = [f"def {name}(first, second):", good if not buggy else bad]
        pairs = [(rng.randint(20, 90), rng.randint(2, 9)) for _ in range(3)]
        cases = [(f"{name}({a}, {b})", eval(f"({a} {op} {b}) + {m}")) for a, b in pairs]  # noqa: S307 - our ints
    elif kind == "swapped":
        helper = f"_{name}_part"
        good = f"    return {helper}(total, part)"
        bad = f"    return {helper}(part, total)"
        body = [f"def {helper}(whole, piece):", f"    return whole * {k} - piece",
                f"def {name}(total, part):", good if not buggy else bad]
        pairs = [(rng.randint(10, 50), rng.randint(1, 9)) for _ in range(3)]
        cases = [(f"{name}({a}, {b})", a * k - b) for a, b in pairs]
    else:  # missing_case: the negative branch
        good = f"        return -{k}"
        bad = f"        return {k}"
        body = [f"def {name}(value):", "    if value > 0:", f"        return {m}", "    if value < 0:",
                good if not buggy else bad, "    return 0"]
        cases = [(f"{name}({x})", m) for x in rng.sample(range(1, 30), 1)] + [(f"{name}(0)", 0)] + \
                [(f"{name}({-x})", -k) for x in rng.sample(range(1, 30), 2)]
    return body, good, {"swapped": 3, "missing_case": 4}.get(kind, 1), cases


def generate(seed: int, *, split: str = "train", difficulty: int = 1, kind: str | None = None) -> Task:
    """One task, the same for the same (seed, split, difficulty, kind)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: give 'train' or 'heldout'")
    if difficulty not in (0, 1, 2):
        raise ValueError(f"difficulty={difficulty!r}: give 0, 1 or 2")
    rng = random.Random(f"coding-fix/{split}/{seed}/{difficulty}/{kind}")
    kind = kind or rng.choice(KINDS)
    modules = rng.sample(_MODULES, 1 + difficulty)
    per_module = 1 + difficulty + (difficulty > 0)
    names = iter(rng.sample([f"{v}_{n}" for v in _VERBS for n in _NOUNS], len(modules) * per_module))
    buggy_module, buggy_index = rng.randrange(len(modules)), rng.randrange(per_module)
    files: dict[str, str] = {"pkg/__init__.py": ""}
    tests: list[str] = []
    fix = None
    entry = None
    for mi, module in enumerate(modules):
        lines = ['"""Part of the package."""', ""]
        for fi in range(per_module):
            name = next(names)
            buggy = (mi, fi) == (buggy_module, buggy_index)
            own_kind = kind if buggy else rng.choice(KINDS)
            body, good, at, cases = _function(rng, own_kind, name, buggy)
            if buggy:
                fix = (f"pkg/{module}.py", len(lines) + at + 1, good)
                entry = (module, name, cases)
            lines += body + ["", ""]
            for call, value in cases:
                tests.append(f"    def test_{len(tests)}(self):\n        self.assertEqual({module}.{call}, {value!r})")
        files[f"pkg/{module}.py"] = "\n".join(lines).rstrip() + "\n"
    assert fix is not None and entry is not None
    if difficulty == 2:  # reached through a caller: the failing test names the caller, not the function
        module, name, cases = entry
        caller = f"report_{name}"
        files[f"pkg/{modules[-1]}.py"] += (f"\n\nfrom .{module} import {name}\n\n\ndef {caller}(*args):\n"
                                          f"    return {{'value': {name}(*args)}}\n")
        for call, value in cases:
            tests.append(f"    def test_{len(tests)}(self):\n        self.assertEqual({modules[-1]}."
                         f"{call.replace(name, caller, 1)}, {{'value': {value!r}}})")
    head = ["import os", "import sys", "import unittest", "",
            "sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))", "",
            f"from pkg import {', '.join(modules)}  # noqa: E402", "", "", "class TestPkg(unittest.TestCase):"]
    files["tests/test_pkg.py"] = "\n".join(head + tests) + "\n\n\nif __name__ == '__main__':\n    unittest.main()\n"
    prompt = "Some tests of this package fail. Run them, find the wrong line, fix it, run them again. Keep the tests."
    task_id = f"{split}-{difficulty}-{seed}"
    return Task(task_id=task_id, split=split, kind=kind, difficulty=difficulty, files=files, fix=fix, prompt=prompt,
                meta={"modules": modules, "functions": len(modules) * per_module})


def test_command() -> list[str]:
    """How a task's tests run, in its sandbox (the system's python3 and its unittest). ``-B``: no bytecode is
    written, so an edit of the same size within the same second as the last run is never hidden by a stale .pyc
    (which it was: the compiled module is checked by the source's mtime in seconds and its size)."""
    return ["python3", "-B", "-m", "unittest", "-q", "tests.test_pkg"]


def verify(task: Task, backend: str = "bwrap") -> None:
    """Refuse a task whose tests do not fail as generated, or do not pass with the fix: run both in sandboxes."""
    import tempfile

    from lightning_rl.sandbox import open_sandbox

    with tempfile.TemporaryDirectory() as scratch:
        for fixed in (False, True):
            folder = task.write(Path(scratch) / ("fixed" if fixed else "broken"), fixed=fixed)
            with open_sandbox(backend, folder) as box:
                done = box.run(test_command(), timeout=60)
            if done.ok != fixed:
                state = "with the fix applied" if fixed else "as generated"
                raise ValueError(f"task {task.task_id} ({task.kind}): its tests {'fail' if fixed else 'pass'} {state}"
                                 f"; refused ({(done.stderr or done.stdout)[-300:]})")


def split(name: str, count: int, *, difficulty: int = 1, start: int = 0) -> list[Task]:
    """``count`` tasks of a split (seeds ``start``.. of that split's own stream), each verified."""
    tasks = [generate(seed, split=name, difficulty=difficulty) for seed in range(start, start + count)]
    for task in tasks:
        verify(task)
    return tasks
