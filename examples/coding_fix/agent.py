"""The coding-fix agent (issue 56): a plain OpenAI client calling the served model with the family's three tools,
each run in the try's own sandbox (``tools.py``): run the tests, read the file they point at, edit a line, run the
tests again. Its reward is not its own: the harness runs the task's tests after it ends (``tools.score``).

``SYSTEM`` and the turns are what the tiny coding model was warm-started on (``traces.py``)."""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lightning_rl as lrl
from lightning_rl.tracer import current_rollout, tracing

import tools

SYSTEM = "Fix the bug with the tools."
MAX_TURNS = 6
MAX_TOKENS = 200  # the longest tool call: an edit_line with a line of the package (about 140 characters)
#: the tools wait on their sandboxes in these threads, off the event loop the tries share (asyncio's default pool has
#: cpu_count + 4 threads: 6 here, fewer than the tries in flight)
_TOOL_THREADS = ThreadPoolExecutor(64, thread_name_prefix="coding-fix-tool")


def make_agent(client: Any, model: str, temperature: float, *, seeded_by_version: bool = True,
               run_tests_delay: Callable[[dict, int, int], float] | None = None, first_tool: str | None = None):
    """The agent, traced as ``coding_fix``. Sampling is seeded by the task, the try and (``seeded_by_version``) the
    policy version, so a run is reproducible; an evaluation keeps the same seeds before and after training.
    ``run_tests_delay(task, attempt, version)``: seconds each ``run_tests`` waits inside its tool span before the tests
    run (a stated environment latency, for the overlap benchmark: a real repository's tests take seconds).
    ``first_tool``: the first turn calls this tool, with no arguments (guided decoding: tests force the path whatever
    the model; such a call is recorded as guided, and not trained on by default)."""

    @lrl.trace(agent="coding_fix")
    async def coding_fix_agent(task: dict) -> None:
        state = current_rollout()
        version = tracing.policy_version(model) if seeded_by_version else 0
        seed = zlib.crc32(json.dumps([task, state.attempt, version]).encode()) & 0x7FFFFFFF
        messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
        for turn in range(MAX_TURNS):
            forced = ({"extra_body": {"structured_outputs": {"regex": re.escape(  # its exact call, in the model's format
                f'<tool_call>{{"name": "{first_tool}", "arguments": {{}}}}</tool_call>')}}}
                if first_tool and turn == 0 else {})
            reply = await client.chat.completions.create(
                model=model, messages=messages, tools=tools.TOOLS, temperature=temperature,
                max_tokens=MAX_TOKENS, seed=seed + turn, **forced)
            message = reply.choices[0].message
            if not message.tool_calls:
                return None  # it says it is done; the harness's tests say whether it is
            messages.append({"role": "assistant", "content": message.content or "", "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                for c in message.tool_calls]})
            for c in message.tool_calls:
                try:
                    arguments = json.loads(c.function.arguments or "{}")
                except ValueError:
                    arguments = None
                if isinstance(arguments, dict):  # the tools wait on the sandbox: off the loop the other tries share
                    delay = (run_tests_delay(task, state.attempt, version)
                             if run_tests_delay is not None and c.function.name == "run_tests" else 0.0)
                    call = contextvars.copy_context().run  # the try's rollout and sandbox go with the call
                    answer = await asyncio.get_running_loop().run_in_executor(
                        _TOOL_THREADS, call, _call_tool, c.function.name, arguments, c.id, delay)
                else:
                    answer = f"error: the arguments are not a JSON object: {c.function.arguments!r}"
                messages.append({"role": "tool", "tool_call_id": c.id, "content": answer})
        return None

    return coding_fix_agent


def _call_tool(name: str, arguments: dict, call_id: str | None, delay: float) -> str:
    if delay and name == "run_tests" and not arguments:
        return tools.run_tests(call_id, delay=delay)
    return tools.call(name, arguments, call_id=call_id)
