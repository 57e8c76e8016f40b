"""Real AutoGen agents and teams for the tests (also run as a script in a subprocess).

The solver's first move is forced, not sampled: its client names the calculator in ``tool_choice``,
and the calculator is a ``strict`` tool whose argument is a pattern, so vLLM produces exactly one
valid call whatever the tiny model would say.
"""

from __future__ import annotations

import asyncio
import json
import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat, SelectorGroupChat
from autogen_core import CancellationToken
from autogen_core.tools import BaseTool
from autogen_ext.models.openai import OpenAIChatCompletionClient
from pydantic import BaseModel, Field

MODEL_INFO = {"vision": False, "function_calling": True, "json_output": True, "family": "unknown",
              "structured_output": True}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 (tests only)
    except Exception as exc:
        return f"error: {exc}"


class CalculatorArgs(BaseModel):
    expression: str = Field(description="two numbers and a plus, e.g. 12+30", pattern=r"^[0-9]{1,3}[+][0-9]{1,3}$")


class Calculator(BaseTool[CalculatorArgs, str]):
    def __init__(self) -> None:
        super().__init__(CalculatorArgs, str, "calculator", "Evaluate an arithmetic expression.", strict=True)

    async def run(self, args: CalculatorArgs, cancellation_token: CancellationToken) -> str:
        return calculator(args.expression)


CALCULATOR = Calculator()


class ToolFirstClient(OpenAIChatCompletionClient):
    """AssistantAgent always asks for tool_choice="auto"; this client names the calculator whenever
    tools are offered, so the tool path runs on every model (one call, never several)."""

    async def create(self, messages, *, tools=(), tool_choice="auto", **kwargs):
        return await super().create(messages, tools=tools, tool_choice=CALCULATOR if tools else tool_choice, **kwargs)

    def create_stream(self, messages, *, tools=(), tool_choice="auto", **kwargs):
        return super().create_stream(messages, tools=tools, tool_choice=CALCULATOR if tools else tool_choice, **kwargs)


def client(base_url: str, *, tool_first: bool = False, model: str = "tiny") -> OpenAIChatCompletionClient:
    cls = ToolFirstClient if tool_first else OpenAIChatCompletionClient
    return cls(model=model, base_url=base_url, api_key="EMPTY", model_info=MODEL_INFO, max_tokens=120, temperature=0.0)


def solver(base_url: str, *, stream: bool = False, model: str = "tiny") -> AssistantAgent:
    return AssistantAgent("solver", model_client=client(base_url, tool_first=True, model=model), tools=[CALCULATOR],
                          system_message="Be exact.", model_client_stream=stream)


def checker(base_url: str, *, model: str = "tiny") -> AssistantAgent:
    return AssistantAgent("checker", model_client=client(base_url, model=model),
                          system_message="Answer with the number.")


def round_robin(base_url: str, *, stream: bool = False, models: dict[str, str] | None = None) -> RoundRobinGroupChat:
    """Solver then checker; ``models`` names each agent's served model (a LoRA policy each), else the base."""
    models = models or {}
    return RoundRobinGroupChat([solver(base_url, stream=stream, model=models.get("solver", "tiny")),
                                checker(base_url, model=models.get("checker", "tiny"))],
                               termination_condition=MaxMessageTermination(4))


def selector(base_url: str) -> SelectorGroupChat:
    return SelectorGroupChat([solver(base_url), checker(base_url)], model_client=client(base_url),
                             termination_condition=MaxMessageTermination(3), max_selector_attempts=1)


if __name__ == "__main__":  # python autogen_agents.py BASE_URL DB: one team rollout with a global provider
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import lightning_rl as lrl

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    lrl.configure(store=f"sqlite:///{sys.argv[2]}")

    @lrl.trace
    async def team_run(question):
        await round_robin(sys.argv[1]).run(task=question)
        return 1.0

    asyncio.run(team_run("What is 12+30?"))
    print(json.dumps(sorted({s.name for s in exporter.get_finished_spans()})))
