"""The coding-fix tools (issue 56): each runs in the try's own sandbox (``lrl.sandbox()``) and is a tool span of its
own (``execute_tool run_tests`` / ``read_file`` / ``edit_line``, with the model's call id when it gives one); what
it returns is what the model sees. ``score`` is the harness's reward after the agent ends: the task's tests, with
``tests`` restored first (``Runner(score=score, protect=["tests"])``).

The tools' schemas (``TOOLS``) are OpenAI function tools; ``call(name, arguments)`` runs one by name.
"""

from __future__ import annotations

import json
from typing import Any

import lightning_rl as lrl

#: What a tool's answer keeps of the tests' output (the end of it: where unittest says what failed).
OUTPUT_CHARS = 1500

TOOLS = [
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the package's tests; returns their output.",
        "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the package, with line numbers.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "edit_line", "description": "Replace one line (1-based) of a file with new text.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "line": {"type": "integer"}, "text": {"type": "string"}},
            "required": ["path", "line", "text"]}}},
]


def run_tests(call_id: str | None = None) -> str:
    from tasks import test_command

    with lrl.tool_span("run_tests", call_id=call_id, arguments="{}") as span:
        done = lrl.sandbox().box.run(test_command(), timeout=60)
        answer = ("PASSED" if done.ok else "FAILED") + "\n" + (done.stderr + done.stdout)[-OUTPUT_CHARS:]
        span.result = answer
    return answer


def read_file(path: str, call_id: str | None = None) -> str:
    with lrl.tool_span("read_file", call_id=call_id, arguments=json.dumps({"path": path})) as span:
        try:
            text = lrl.sandbox().get(path).decode(errors="replace")
            answer = "\n".join(f"{n}: {line}" for n, line in enumerate(text.split("\n"), 1))
        except (OSError, ValueError) as exc:  # a path the model got wrong: what it sees, not a failure of the try
            answer = f"error: {exc}"
        span.result = answer
    return answer


def edit_line(path: str, line: int, text: str, call_id: str | None = None) -> str:
    arguments = json.dumps({"path": path, "line": line, "text": text})
    with lrl.tool_span("edit_line", call_id=call_id, arguments=arguments) as span:
        box = lrl.sandbox()
        try:
            lines = box.get(path).decode().split("\n")
            if not isinstance(line, int) or not 1 <= line <= len(lines):
                raise ValueError(f"line {line!r} is not a line of {path} (1-{len(lines)})")
            lines[line - 1] = text
            box.put(path, "\n".join(lines))
            answer = f"ok: {path}:{line} is now {text!r}"
        except (OSError, ValueError) as exc:
            answer = f"error: {exc}"
        span.result = answer
    return answer


def call(name: str, arguments: dict[str, Any], call_id: str | None = None) -> str:
    """Run the tool ``name`` with the model's ``arguments``; an unknown tool or bad arguments are an answer."""
    tools = {"run_tests": run_tests, "read_file": read_file, "edit_line": edit_line}
    if name not in tools:
        return f"error: no tool {name!r}; the tools are {sorted(tools)}"
    try:
        return tools[name](**arguments, call_id=call_id)
    except TypeError as exc:
        return f"error: {exc}"


def score(task: Any, box: Any) -> float:
    """The try's reward: 1.0 when the task's own tests pass (the runner restored them first), else 0.0."""
    from tasks import test_command

    return 1.0 if box.run(test_command(), timeout=60).ok else 0.0
