"""The OpenAI Agents SDK scenario the telemetry-off tests run: ``triage`` hands arithmetic to ``math tutor``, who
must call the ``calculator`` tool (both choices forced: a named tool choice with a bounded pattern, temperature 0).

Imported by tests/adapters/test_telemetry_off_vllm.py, and run as a fresh process for the switch that is read
once per process (``OPENAI_AGENTS_DISABLE_TRACING``):

    python agents_sdk_scenario.py BASE_URL DB   (from this directory; ``Runner.run_sync``; exits 0 once recorded)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning_rl as lrl

SERVED_NAME = "tiny"
PATTERN = "^[0-9]{1,3}[+][0-9]{1,3}$"
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string", "pattern": PATTERN}},
          "required": ["expression"], "additionalProperties": False}
QUESTION = "What is 12+30?"


def add(expression: str) -> str:
    a, b = expression.split("+")
    return str(int(a) + int(b))


def triage_agent(agents: Any, base_url: str, *, tools: list[Any] | None = None, mcp_servers: list[Any] | None = None,
                 tool: str = "calculator") -> Any:
    """``triage`` (forced to hand off) in front of ``math tutor`` (forced to call ``tool``)."""
    from openai import AsyncOpenAI

    agents.set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0),
                                     use_for_tracing=False)
    if tools is None and not mcp_servers:
        async def invoke(ctx: Any, args: str) -> str:
            return add(json.loads(args)["expression"])

        tools = [agents.FunctionTool(name="calculator", description="Evaluate an arithmetic expression.",
                                     params_json_schema=SCHEMA, on_invoke_tool=invoke, strict_json_schema=True)]
    tutor = agents.Agent(name="math tutor", instructions="Use the calculator.", model=SERVED_NAME, tools=tools or [],
                         mcp_servers=mcp_servers or [], mcp_config={"convert_schemas_to_strict": True},
                         model_settings=agents.ModelSettings(tool_choice=tool, temperature=0, max_tokens=200))
    return agents.Agent(name="triage", instructions="Hand arithmetic to the math tutor.", model=SERVED_NAME,
                        handoffs=[tutor], model_settings=agents.ModelSettings(
                            tool_choice="transfer_to_math_tutor", temperature=0, max_tokens=200))


if __name__ == "__main__":
    import agents

    store = lrl.configure(store=f"sqlite:///{sys.argv[2]}")
    triage = triage_agent(agents, sys.argv[1])

    @lrl.trace
    def solve(question: str) -> float:
        agents.Runner.run_sync(triage, question, max_turns=3)
        return 1.0

    try:
        solve(QUESTION)
    except agents.exceptions.AgentsException:
        pass  # a turn limit or the model's words: what was recorded is what the test asserts
    store.close()
