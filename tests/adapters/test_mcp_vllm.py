"""MCP tools in an agent loop against the real vLLM server (issue 45): the model's tool call, executed through an
MCP client session (raw, or a framework's MCP support), is exactly one ``execute_tool`` span carrying the model's
call id, the arguments it sent and the server's result. Tool use is forced (a named tool choice; the MCP tool's
argument has a bounded pattern, so guided decoding always makes a call the server can run), temperature 0; what is
asserted is what was recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl import semconv

from ..conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm]
mcp = pytest.importorskip("mcp")
SERVER = Path(__file__).with_name("mcp_server.py")
SERVER_NAME = "lrl-test-tools"
QUESTION = "What is 12+30? Use the calculator."


def _add(expression: str) -> str:
    a, b = expression.split("+")
    return str(int(a) + int(b))


def _one_span_per_call(traj) -> list:
    """Each calculator call the model made has exactly one tool span: its id, its arguments, the server's result."""
    asked = [tc for call in traj.llm_calls for tc in call.tool_calls if tc.name == "calculator"]
    spans = [s for s in traj.tool_spans if s.attributes[semconv.GEN_AI_TOOL_NAME] == "calculator"]
    assert asked, "the model made no calculator call"
    assert len(spans) == len(asked), [s.attributes for s in spans]
    by_id = {tc.id: tc for tc in asked}
    assert len(by_id) == len(asked) and {s.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) for s in spans} == set(by_id)
    for span in spans:
        arguments = json.loads(span.attributes[semconv.TOOL_ARGUMENTS])
        assert arguments == json.loads(by_id[span.attributes[semconv.GEN_AI_TOOL_CALL_ID]].arguments)
        assert _add(arguments["expression"]) in span.attributes[semconv.TOOL_RESULT]
    return spans


def _stdio_params():
    return mcp.StdioServerParameters(command=sys.executable, args=[str(SERVER)])


async def test_raw_client_session_in_an_agent_loop_carries_the_models_call_id(traced, vllm_url):
    from mcp.client.stdio import stdio_client
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)

    @lrl.trace
    async def agent(question):
        async with stdio_client(_stdio_params()) as (read, write), mcp.ClientSession(read, write) as session:
            await session.initialize()
            tools = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "strict": True,
                "parameters": t.input_schema}}
                for t in (await session.list_tools()).tools if t.name == "calculator"]
            messages = [{"role": "user", "content": question}]
            response = await client.chat.completions.create(
                model=SERVED_NAME, messages=messages, tools=tools, temperature=0, max_tokens=200,
                tool_choice={"type": "function", "function": {"name": "calculator"}})
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = await session.call_tool(call.function.name, json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.content[0].text})
        return 1.0

    await agent(QUESTION)
    (traj,) = lrl.trajectories(traced)
    assert traj.llm_calls[0].token_ids_source == "engine"
    (span,) = _one_span_per_call(traj)
    assert span.attributes[semconv.MCP_SERVER_NAME] == SERVER_NAME
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_ID] == traj.llm_calls[0].tool_calls[0].id


async def test_langchain_tool_over_mcp_is_one_span_with_the_models_call_id(traced, vllm_url):
    """A LangChain tool that calls an MCP server (as ``langchain-mcp-adapters`` makes them: that package pins
    ``mcp<2``, so it does not install beside the MCP SDK 2.x): LangChain's tool span, with the model's call id,
    is the one span; the session call inside it is not a second."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import StructuredTool
    from mcp.client.stdio import stdio_client
    from pydantic import BaseModel, Field

    class Expression(BaseModel):
        expression: str = Field(pattern="^[0-9]{1,3}[+][0-9]{1,3}$")

    llm = langchain_openai.ChatOpenAI(model=SERVED_NAME, base_url=vllm_url, api_key="EMPTY", max_tokens=200,
                                      temperature=0.0)

    @lrl.trace
    async def agent(question):
        async with stdio_client(_stdio_params()) as (read, write), mcp.ClientSession(read, write) as session:
            await session.initialize()

            async def calculator(expression: str) -> str:
                return (await session.call_tool("calculator", {"expression": expression})).content[0].text

            tool = StructuredTool.from_function(coroutine=calculator, name="calculator", args_schema=Expression,
                                                description="Evaluate an addition like 12+30.")
            ai = await llm.bind_tools([tool], tool_choice="calculator", strict=True).ainvoke(question)
            for call in ai.tool_calls:
                await tool.ainvoke({**call, "type": "tool_call"})
        return 1.0

    await agent(QUESTION)
    (traj,) = lrl.trajectories(traced)
    spans = _one_span_per_call(traj)
    assert semconv.MCP_SERVER_NAME not in spans[0].attributes  # LangChain's span, not the session's


async def test_pydantic_ai_mcp_toolset_is_one_span_per_call_with_the_models_call_id(traced, vllm_url):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    try:
        from fastmcp.client import Client
        from fastmcp.client.transports import StdioTransport
        from pydantic_ai.mcp import MCPToolset
    except ImportError as exc:
        pytest.skip(f"PydanticAI's MCP support is not installed: {exc}")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel(SERVED_NAME, provider=OpenAIProvider(base_url=vllm_url, api_key="EMPTY"))
    force = {"tool_choice": {"type": "function", "function": {"name": "calculator"}}}
    toolset = MCPToolset(Client(StdioTransport(command=sys.executable, args=[str(SERVER)]))).filtered(
        lambda ctx, tool: tool.name == "calculator")  # the one tool offered (the tiny model's forced call ends)
    agent = pydantic_ai.Agent(model, name="calc agent", instructions="Use the calculator.", toolsets=[toolset],
                              model_settings=pydantic_ai.ModelSettings(temperature=0, max_tokens=200, extra_body=force))

    @lrl.trace
    async def solve(question):
        await agent.run(question, usage_limits=UsageLimits(request_limit=2))  # forced every turn: then the limit
        return 1.0

    with pytest.raises(pydantic_ai.exceptions.UsageLimitExceeded):
        await solve(QUESTION)
    (traj,) = lrl.trajectories(traced)
    spans = _one_span_per_call(traj)
    assert {s.attributes.get(semconv.GEN_AI_AGENT_NAME) for s in spans} == {"calc agent"}


async def test_openai_agents_sdk_mcp_server_is_one_span_per_call_with_the_models_call_id(traced, vllm_url):
    agents = pytest.importorskip("agents")
    from agents.mcp import MCPServerStdio
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    settings = agents.ModelSettings(tool_choice="calculator", temperature=0, max_tokens=200)

    @lrl.trace
    async def solve(question):
        async with MCPServerStdio(params={"command": sys.executable, "args": [str(SERVER)]}, name="lrl-tools",
                                  tool_filter={"allowed_tool_names": ["calculator"]}) as server:
            tutor = agents.Agent(name="math tutor", instructions="Use the calculator.", mcp_servers=[server],
                                 mcp_config={"convert_schemas_to_strict": True},
                                 model=agents.OpenAIChatCompletionsModel(model=SERVED_NAME, openai_client=client),
                                 model_settings=settings)
            await agents.Runner.run(tutor, question, max_turns=2)
        return 1.0

    try:
        await solve(QUESTION)
    except agents.exceptions.AgentsException:
        pass  # the tool is forced every turn: a turn limit, and what was recorded is what is asserted
    (traj,) = lrl.trajectories(traced)
    spans = _one_span_per_call(traj)
    assert {s.attributes.get(semconv.GEN_AI_AGENT_NAME) for s in spans} == {"math tutor"}
