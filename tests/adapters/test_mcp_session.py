"""Tool calls through the ``mcp`` SDK's client session are tool spans (issue 45), with no vLLM: a real MCP server
(``mcp_server.py``) over stdio, over streamable HTTP (a subprocess on a free loopback port) and in process.
Each span carries the arguments, the result, the error status of a failed tool or a raised call, the server's
name, and the model's call id where the rollout's LLM answers asked for the call. A call made inside a tool a
framework adapter records (LangChain, AutoGen, the wrapped frameworks) is that framework's span, not a second."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.tracer.context import current_rollout

mcp = pytest.importorskip("mcp")
from mcp.client.stdio import stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

SERVER = Path(__file__).with_name("mcp_server.py")
SERVER_NAME = "lrl-test-tools"
ERROR_TEXT = "Error executing tool divide: cannot divide by zero"  # the server's isError text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_server():
    """The test server as a real process speaking streamable HTTP on 127.0.0.1."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the MCP test server did not start: {process.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@asynccontextmanager
async def _session(transport: str, url: str | None = None):
    if transport == "stdio":
        streams = stdio_client(mcp.StdioServerParameters(command=sys.executable, args=[str(SERVER)]))
    else:
        streams = streamable_http_client(url)
    async with streams as (read, write), mcp.ClientSession(read, write) as session:
        await session.initialize()
        yield session


def _spans(store) -> list:
    (traj,) = lrl.trajectories(store)
    return traj.tool_spans


@pytest.mark.parametrize("transport", ["stdio", "streamable HTTP"])
async def test_session_tool_calls_are_tool_spans(traced, request, transport):
    url = request.getfixturevalue("http_server") if transport != "stdio" else None
    seen = {}

    @lrl.trace
    async def agent():
        # what an LLM call of this rollout asked for (the OpenAI adapter notes it so): the session never knows it
        current_rollout().note_tool_calls([("calculator", '{"expression": "12+30"}', "call_model_1")])
        async with _session("stdio" if transport == "stdio" else "http", url) as session:
            seen["sum"] = await session.call_tool("calculator", {"expression": "12+30"})
            seen["quotient"] = await session.call_tool(name="divide", arguments={"a": 1, "b": 4})
            seen["failed"] = await session.call_tool("divide", {"a": 1, "b": 0})
            with pytest.raises(MCPError, match="timed out") as raised:
                await session.call_tool("sleep", {"seconds": 2}, read_timeout_seconds=0.3)
            seen["raised"] = raised.value
        return 1.0

    await agent()
    # the caller gets what the SDK gives, unchanged
    assert seen["sum"].content[0].text == "42" and not seen["sum"].is_error
    assert seen["failed"].is_error and seen["failed"].content[0].text == ERROR_TEXT

    calc, quotient, failed, slow = _spans(traced)
    assert [s.name for s in (calc, quotient, failed, slow)] == [
        "execute_tool calculator", "execute_tool divide", "execute_tool divide", "execute_tool sleep"]
    for span in (calc, quotient, failed, slow):
        assert span.attributes[semconv.MCP_SERVER_NAME] == SERVER_NAME
        assert span.attributes[semconv.MCP_METHOD_NAME] == "tools/call"
        assert span.attributes[semconv.GEN_AI_OPERATION_NAME] == "execute_tool"

    assert calc.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_model_1"  # the model's call, claimed
    assert json.loads(calc.attributes[semconv.TOOL_ARGUMENTS]) == {"expression": "12+30"}
    assert json.loads(calc.attributes[semconv.TOOL_RESULT]) == {"result": "42"}  # the structured content
    assert calc.status_code != "ERROR"

    assert semconv.GEN_AI_TOOL_CALL_ID not in quotient.attributes  # the model asked for no divide
    assert json.loads(quotient.attributes[semconv.TOOL_ARGUMENTS]) == {"a": 1, "b": 4}
    assert json.loads(quotient.attributes[semconv.TOOL_RESULT]) == {"result": 0.25}

    # isError: true is a failed tool, with its text
    assert failed.status_code == "ERROR" and failed.status_message == ERROR_TEXT
    assert failed.attributes[semconv.TOOL_RESULT] == ERROR_TEXT

    # a raised call: the exception on the span, no result
    assert slow.status_code == "ERROR" and slow.status_message.startswith("MCPError: ") and "timed out" in \
        slow.status_message
    assert semconv.TOOL_RESULT not in slow.attributes
    # nothing failed (how long the agent's thread waited for the store's writer depends on the machine's load)
    went_wrong = {name: n for name, n in lrl.stats().items() if not name.startswith("writer_")}
    assert went_wrong == {"rollouts_without_llm_calls": 1, "rollout without llm calls": 1}


async def test_the_high_level_client_in_process_is_one_span_per_call(traced):
    from . import mcp_server

    @lrl.trace
    async def agent():
        async with mcp.Client(mcp_server.server) as client:
            return float((await client.call_tool("calculator", {"expression": "1+2"})).content[0].text)

    assert await agent() == 3.0
    (span,) = _spans(traced)
    assert span.name == "execute_tool calculator" and span.attributes[semconv.MCP_SERVER_NAME] == SERVER_NAME
    assert json.loads(span.attributes[semconv.TOOL_RESULT]) == {"result": "3"}


async def test_outside_a_rollout_a_call_only_calls_through(traced):
    from . import mcp_server

    async with mcp.Client(mcp_server.server) as client:
        result = await client.call_tool("calculator", {"expression": "1+2"})
    assert result.content[0].text == "3"
    assert list(lrl.trajectories(traced)) == [] and lrl.stats() == {}


async def test_a_call_inside_a_framework_tool_is_not_a_second_span(traced):
    from . import mcp_server

    @lrl.trace
    async def agent():
        state = current_rollout()
        async with mcp.Client(mcp_server.server) as client:
            state.framework_tool_started()  # as a framework adapter does when its tool starts
            try:
                await client.call_tool("calculator", {"expression": "1+1"})
            finally:
                state.framework_tool_ended()
            await client.call_tool("calculator", {"expression": "2+2"})
        return 1.0

    await agent()
    (span,) = _spans(traced)
    assert json.loads(span.attributes[semconv.TOOL_ARGUMENTS]) == {"expression": "2+2"}


async def test_an_mcp_call_inside_a_langchain_tool_is_the_langchain_tool_span(traced):
    pytest.importorskip("langchain_core")
    from langchain_core.tools import StructuredTool

    from . import mcp_server

    async def run(client, expression: str) -> str:
        result = await client.call_tool("calculator", {"expression": expression})
        if expression == "0+0":
            raise ValueError("zero")
        return result.content[0].text

    @lrl.trace
    async def agent():
        async with mcp.Client(mcp_server.server) as client:
            async def calculator(expression: str) -> str:
                """Add two numbers written as 12+30."""
                return await run(client, expression)

            tool = StructuredTool.from_function(coroutine=calculator, name="calculator")
            message = await tool.ainvoke({"type": "tool_call", "id": "call_lc_1", "name": "calculator",
                                          "args": {"expression": "12+30"}})
            with pytest.raises(ValueError, match="zero"):  # the tool's error path ends the framework's tool too
                await tool.ainvoke({"type": "tool_call", "id": "call_lc_2", "name": "calculator",
                                    "args": {"expression": "0+0"}})
            assert current_rollout().framework_tools == 0
            await client.call_tool("calculator", {"expression": "5+5"})  # a raw call again: its own span
        return float(message.content)

    assert await agent() == 42.0
    langchain_ok, langchain_failed, raw = _spans(traced)
    assert langchain_ok.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_lc_1"
    assert langchain_ok.attributes[semconv.TOOL_RESULT] == "42"
    assert semconv.MCP_SERVER_NAME not in langchain_ok.attributes  # LangChain's span, not the session's
    assert langchain_failed.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_lc_2"
    assert langchain_failed.status_code == "ERROR"
    assert raw.attributes[semconv.MCP_SERVER_NAME] == SERVER_NAME
    assert json.loads(raw.attributes[semconv.TOOL_ARGUMENTS]) == {"expression": "5+5"}


async def test_an_mcp_call_inside_an_autogen_tool_is_the_autogen_tool_span(traced):
    pytest.importorskip("autogen_agentchat")
    import autogen_agentchat  # noqa: F401  (instruments AutoGen)
    from autogen_core import CancellationToken
    from autogen_core.tools import FunctionTool

    from . import mcp_server

    @lrl.trace
    async def agent():
        async with mcp.Client(mcp_server.server) as client:
            async def calculator(expression: str) -> str:
                """Add two numbers written as 12+30."""
                return (await client.call_tool("calculator", {"expression": expression})).content[0].text

            tool = FunctionTool(calculator, description="Add two numbers.", name="calculator")
            result = await tool.run_json({"expression": "12+30"}, CancellationToken(), call_id="call_ag_1")
        assert current_rollout().framework_tools == 0
        return float(result)

    assert await agent() == 42.0
    (span,) = _spans(traced)
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_ag_1"
    assert semconv.MCP_SERVER_NAME not in span.attributes


def test_a_wrapped_framework_tool_counts_as_the_rollouts_framework_tool(traced):
    """smolagents, CrewAI and LlamaIndex record their tools through ``wrapping.record_tool``: while one runs
    (and only then, its error path included) the rollout counts a framework tool."""
    from lightning_rl.adapters.wrapping import record_tool

    class Tool:
        name = "lookup"

        def __call__(self, key: str) -> str:
            if key == "missing":
                raise KeyError(key)
            return str(current_rollout().framework_tools)

    record_tool(Tool, "__call__", lambda tool: tool.name, lambda tool, args, kwargs: {"key": args[0]})

    @lrl.trace
    def agent():
        inside = Tool()("a")
        with pytest.raises(KeyError):
            Tool()("missing")
        return float(inside) + current_rollout().framework_tools

    assert agent() == 1.0  # 1 while the tool ran, 0 after both calls
    ok, failed = _spans(traced)
    assert ok.attributes[semconv.TOOL_RESULT] == "1" and failed.status_code == "ERROR"


@pytest.mark.parametrize("imports", [
    "import lightning_rl; import mcp",  # the post-import hook
    "import mcp; import lightning_rl",  # already loaded: instrumented at lightning_rl's import
    "import lightning_rl.adapters.mcp; import mcp",  # the adapter module first (the import-order defect)
])
def test_the_session_is_instrumented_whatever_the_import_order(imports):
    code = (f"{imports}; from mcp.client.session import ClientSession; import lightning_rl; "
            "assert getattr(ClientSession.call_tool, '__lightning_rl__', False); assert lightning_rl.stats() == {}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
