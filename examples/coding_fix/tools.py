"""The coding-fix tools (issue 56): each runs in the try's own sandbox (``lrl.sandbox()``) and is a tool span of its
own (``execute_tool run_tests`` / ``read_file`` / ``edit_line``, with the model's call id when it gives one); what
it returns is what the model sees. ``score`` is the harness's reward after the agent ends: the task's tests, with
``tests`` restored first (``Runner(score=score, protect=["tests"])``).

The tools' schemas (``TOOLS``) are OpenAI function tools; ``call(name, arguments)`` runs one by name.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import lightning_rl as lrl

#: The most failures ``run_tests`` reports (the rest are counted): what a small model's context holds.
FAILURES_SHOWN = 1
_FRAME = re.compile(r'^\s*File "(?:[^"]*?/)?((?:pkg|tests)/[^"/]+)", line (\d+)')  # a frame in the task's files

TOOLS = [
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the package's tests; returns their output.",
        "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the package, with line numbers.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "replace", "description": "In one line (1-based) of a file, replace the text old with new.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "line": {"type": "integer"}, "old": {"type": "string"},
            "new": {"type": "string"}}, "required": ["path", "line", "old", "new"], "additionalProperties": False}}},
]
#: ``edit_line`` (a whole line) is a tool too (``call``), not offered to the tiny model: its long lines to copy are
#: where it goes wrong; ``replace`` asks only for the part that changes
EDIT_LINE = {"type": "function", "function": {
    "name": "edit_line", "description": "Replace one line (1-based) of a file with new text.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "text": {"type": "string"}},
        "required": ["path", "line", "text"], "additionalProperties": False}}}


#: how long each ``run_tests`` command itself took (seconds), in this process: the real cost beside a stated delay
RUN_TESTS_SECONDS: list[float] = []


def run_tests(call_id: str | None = None, delay: float = 0.0) -> str:
    """The task's tests in the try's sandbox, summarized. ``delay``: seconds waited first, inside the span (a stated
    environment latency, for benchmarks; never set by the model: ``call`` refuses it)."""
    from tasks import test_command

    with lrl.tool_span("run_tests", call_id=call_id, arguments="{}") as span:
        if delay:
            time.sleep(delay)
        done = lrl.sandbox().box.run(test_command(), timeout=60)
        RUN_TESTS_SECONDS.append(done.duration)
        answer = summarize(done.ok, done.stderr + done.stdout)
        span.result = answer
    return answer


def summarize(ok: bool, output: str) -> str:
    """What ``run_tests`` answers: PASSED or FAILED with the count, then a line per failure (up to
    ``FAILURES_SHOWN``): where it failed (the innermost frame in the task's files, relative to the task), that line,
    and the error. unittest's own output is long and mostly the same; a small model reads this. When the tests could
    not even be loaded (a module that does not import), the one line says where and why."""
    ran = re.search(r"^Ran (\d+) tests?", output, re.M)
    total = int(ran.group(1)) if ran else 0
    if ok:
        return f"PASSED: {total} tests"
    blocks = re.split(r"^=+\n(?:FAIL|ERROR): [^\n]*\n-+\n", output, flags=re.M)[1:]
    if not ran or not blocks:
        return "FAILED: the tests did not run\n" + _failure(output)
    lines = [f"FAILED: {len(blocks)} of {total} tests"]
    lines += [_failure(block.split("\n" + "-" * 70)[0]) for block in blocks[:FAILURES_SHOWN]]
    if len(blocks) > FAILURES_SHOWN:
        lines.append(f"... {len(blocks) - FAILURES_SHOWN} more")
    return "\n".join(lines)


def _failure(traceback: str) -> str:
    """``path:line: source -> error`` of a traceback's innermost frame in the task's files (else just the error)."""
    body = traceback.rstrip().split("\n")
    error = next((line.strip() for line in reversed(body) if line.strip()), "")
    frames = [(i, m) for i, m in enumerate(_FRAME.match(line) for line in body) if m]
    if not frames:
        return error
    i, where = frames[-1]
    source = body[i + 1].strip() if i + 1 < len(body) and not _FRAME.match(body[i + 1]) else ""
    return f"{where.group(1)}:{where.group(2)}: {source} -> {error}"


def read_file(path: str, call_id: str | None = None) -> str:
    with lrl.tool_span("read_file", call_id=call_id, arguments=json.dumps({"path": path})) as span:
        try:
            text = lrl.sandbox().get(path).decode(errors="replace")
            answer = "\n".join(f"{n}: {line}" for n, line in enumerate(text.split("\n"), 1))
        except (OSError, ValueError) as exc:  # a path the model got wrong: what it sees, not a failure of the try
            answer = f"error: {exc}"
        span.result = answer
    return answer


def _edit(tool: str, path: str, line: int, arguments: dict[str, Any], change: Any, call_id: str | None) -> str:
    """A tool span that changes line ``line`` of ``path`` in the try's sandbox to ``change(text)`` (which raises
    ValueError to refuse); a bad path, line or change is the answer the model sees, not a failure of the try."""
    with lrl.tool_span(tool, call_id=call_id, arguments=json.dumps(arguments)) as span:
        box = lrl.sandbox()
        try:
            lines = box.get(path).decode().split("\n")
            if not isinstance(line, int) or not 1 <= line <= len(lines):
                raise ValueError(f"line {line!r} is not a line of {path} (1-{len(lines)})")
            lines[line - 1] = change(lines[line - 1])
            box.put(path, "\n".join(lines))
            answer = f"ok: {path}:{line} edited"
        except (OSError, ValueError) as exc:
            answer = f"error: {exc}"
        span.result = answer
    return answer


def edit_line(path: str, line: int, text: str, call_id: str | None = None) -> str:
    return _edit("edit_line", path, line, {"path": path, "line": line, "text": text}, lambda _: text, call_id)


def replace(path: str, line: int, old: str, new: str, call_id: str | None = None) -> str:
    def change(current: str) -> str:
        if not isinstance(old, str) or not old or old not in current:
            raise ValueError(f"{old!r} is not in line {line} of {path}")
        return current.replace(old, str(new), 1)

    return _edit("replace", path, line, {"path": path, "line": line, "old": old, "new": new}, change, call_id)


def call(name: str, arguments: dict[str, Any], call_id: str | None = None) -> str:
    """Run the tool ``name`` with the model's ``arguments``; an unknown tool or bad arguments are an answer."""
    tools = {"run_tests": run_tests, "read_file": read_file, "replace": replace, "edit_line": edit_line}
    if name not in tools:
        return f"error: no tool {name!r}; the tools are {sorted(tools)}"
    if {"call_id", "delay"} & set(arguments):
        return f"error: {sorted({'call_id', 'delay'} & set(arguments))} are not arguments of the tools"
    try:
        return tools[name](**arguments, call_id=call_id)
    except TypeError as exc:
        return f"error: {exc}"


def score(task: Any, box: Any) -> float:
    """The try's reward: 1.0 when the task's own tests pass (the runner restored them first), else 0.0."""
    from tasks import test_command

    return 1.0 if box.run(test_command(), timeout=60).ok else 0.0
