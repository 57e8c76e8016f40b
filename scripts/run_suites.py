#!/usr/bin/env python3
"""Run test suites, each a command of its own, and end with one line per suite: its result and minutes.

``make test`` runs every suite through this script, so that a user sees where a run stands: which suite
failed, which passed, what each took, and the set-up before them. A suite that fails does not stop the
others (each runs in an environment of its own); the script exits non-zero when any failed.

Usage: run_suites.py [--lane NAME,NAME...]... NAME=COMMAND ...

Each ``NAME=COMMAND`` is a step, run by the shell. The steps no ``--lane`` names run first, one after another
(``make test``: the set-up); when one of them fails, nothing after it runs. Then every lane runs beside the
others, its steps one after another (``make test``: the main suite in one lane; in another, each other
environment's build, then its suite). Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

#: pytest's last line: "3 failed, 1124 passed, 19 skipped, 60 warnings in 1823.47s (0:30:23)"
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)\b.*?)"
                     r"(?: in [\d.]+s.*)?\s*=*$")
#: pytest's short test summary: "FAILED tests/x.py::test_y - AssertionError: ..." (and ERROR for set-up errors)
FAILURE = re.compile(r"^(?:FAILED|ERROR) \S+")
#: each failure is quoted again at the end, cut to this many characters, so that the last screen of a long run
#: (all that CI's log keeps) names what failed
FAILURE_CHARS = 300


@dataclass
class Suite:
    name: str
    command: str
    began: float = 0.0
    ended: float = 0.0
    status: int | None = None
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None

    @property
    def minutes(self) -> float:
        return (self.ended - self.began) / 60


def parse(argv: list[str]) -> tuple[list[Suite], list[list[Suite]]]:
    """The steps run first, one after another, and the lanes (module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lane", action="append", default=[], metavar="NAME,NAME",
                        help="steps to run one after another, beside the other lanes")
    parser.add_argument("steps", nargs="+", metavar="NAME=COMMAND")
    args = parser.parse_args(argv)
    steps: dict[str, Suite] = {}
    for spec in args.steps:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command or name in steps:
            parser.error(f"a step is NAME=COMMAND with a name of its own, got {spec!r}")
        steps[name] = Suite(name, command)
    lanes = [[name for name in lane.split(",") if name] for lane in args.lane]
    laned = [name for lane in lanes for name in lane]
    for name in laned:
        if name not in steps or laned.count(name) > 1:
            parser.error(f"--lane names {name!r}, which is not a step or is in two lanes; the steps are "
                         f"{', '.join(steps)}")
    first = [step for name, step in steps.items() if name not in laned]
    return first, [[steps[name] for name in lane] for lane in lanes]


def run(suite: Suite, prefix: bool, lock: threading.Lock) -> None:
    """Run one step in a process group of its own, its output passed on line by line (prefixed by its name
    when lanes run side by side)."""
    suite.began = time.time()
    suite.process = subprocess.Popen(suite.command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", start_new_session=True)
    try:
        for line in suite.process.stdout:
            match = SUMMARY.match(line.strip())
            if match:
                suite.summary = match.group(1)
            elif FAILURE.match(line):
                suite.failures.append(line.rstrip()[:FAILURE_CHARS])
            with lock:
                sys.stdout.write(f"[{suite.name}] {line}" if prefix else line)
                sys.stdout.flush()
        suite.status = suite.process.wait()
    finally:
        suite.ended = time.time()


def stop(suites: list[Suite]) -> None:
    """Interrupted (Ctrl-C): every step still running, and what it started, is stopped."""
    for suite in suites:
        if suite.process is not None and suite.process.poll() is None:
            try:
                os.killpg(suite.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def report(suites: list[Suite], began: float) -> list[str]:
    """One line per step: its result, minutes and pytest's summary; each test that failed; then the whole run's."""
    lines = ["", "make test, step by step:"]
    for s in suites:
        result = "not run" if s.status is None else "ok" if s.status == 0 else "FAILED"
        minutes = f"{s.minutes:6.1f} min" if s.status is not None else "      -    "
        said = s.summary or ("" if s.status in (None, 0) else f"exit status {s.status}")
        lines.append(f"  {s.name:<14} {result:<8} {minutes}  {said}")
    failed = [s.name for s in suites if s.status != 0]
    for s in suites:
        lines.extend(f"  [{s.name}] {failure}" for failure in s.failures)
    lines.append(f"  {'in all':<14} {'FAILED' if failed else 'ok':<8} {(time.time() - began) / 60:6.1f} min"
                 + (f"  (failed or not run: {', '.join(failed)})" if failed else ""))
    return lines


def run_lane(lane: list[Suite], prefix: bool, lock: threading.Lock) -> None:
    for suite in lane:
        with lock:
            print(f"\n=== {suite.name}: {suite.command}", flush=True)
        run(suite, prefix, lock)


def main(argv: list[str]) -> int:
    first, lanes = parse(argv)
    began = time.time()
    lock = threading.Lock()
    everything = first + [step for lane in lanes for step in lane]
    try:
        for step in first:
            print(f"\n=== {step.name}: {step.command}", flush=True)
            run(step, False, lock)
            if step.status != 0:
                print(f"run_suites: {step.name} failed (exit status {step.status}); nothing after it was run", flush=True)
                break
        else:
            threads = [threading.Thread(target=run_lane, args=(lane, len(lanes) > 1, lock), daemon=True)
                       for lane in lanes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    except BaseException:
        stop(everything)
        raise
    finally:
        print("\n".join(report(everything, began)), flush=True)
    return 0 if all(s.status == 0 for s in everything) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
