"""What lightning-rl records must not depend on a framework's optional telemetry (issue 45). Teams that serve their
own models switch the OpenAI Agents SDK's tracing off (its default export sends traces to OpenAI) in one of three
ways; with each, and with it on, every agent's name is on its LLM calls and every tool and handoff is one tool span
with the model's call id, against the real vLLM server. Tool use is forced (a named tool choice with a bounded
pattern, temperature 0), and what is asserted is what was recorded whether the agent returned or raised."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.store import SQLiteStore

from . import agents_sdk_scenario as scenario

pytestmark = [pytest.mark.vllm]
HERE = Path(__file__).resolve().parent


def _engine_served(traj) -> None:
    assert traj.llm_calls, "no LLM call recorded"
    for call in traj.llm_calls:
        assert call.token_ids_source == "engine" and call.response_token_ids and call.prompt_token_ids


def _spans(traj, tool: str) -> list:
    return [s for s in traj.tool_spans if s.attributes[semconv.GEN_AI_TOOL_NAME] == tool]


def _check_triage_to_tutor(traj, result_of=lambda result: result) -> None:
    """The handoff scenario as a user reads it back: each call named by its agent, the handoff and each calculator
    call one tool span with the model's call id, arguments and result (``result_of`` reads the sum from what the
    model was told), run by the agent that asked."""
    _engine_served(traj)
    names = [c.agent_name for c in traj.llm_calls]
    assert names[:2] == ["triage", "math tutor"] and set(names) == {"triage", "math tutor"}, names
    (handoff,) = _spans(traj, "transfer_to_math_tutor")
    assert handoff.attributes[semconv.GEN_AI_TOOL_CALL_ID] == traj.llm_calls[0].tool_calls[0].id
    assert handoff.attributes[semconv.GEN_AI_AGENT_NAME] == "triage"
    asked = {tc.id: tc for call in traj.llm_calls for tc in call.tool_calls if tc.name == "calculator"}
    spans = _spans(traj, "calculator")
    assert spans, "no calculator tool span"
    ids = [s.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) for s in spans]
    assert len(ids) == len(set(ids)), f"one tool call recorded twice: {ids}"
    for span in spans:
        call = asked[span.attributes[semconv.GEN_AI_TOOL_CALL_ID]]
        arguments = json.loads(span.attributes[semconv.TOOL_ARGUMENTS])
        assert arguments == json.loads(call.arguments)
        assert result_of(span.attributes[semconv.TOOL_RESULT]) == scenario.add(arguments["expression"])
        assert span.attributes[semconv.GEN_AI_AGENT_NAME] == "math tutor"


@pytest.fixture
def agents():
    return pytest.importorskip("agents")


@pytest.fixture
def tracing_disabled(agents):
    """``agents.set_tracing_disabled(True)`` for the test (the SDK's global switch), restored afterwards."""
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


async def _run(agents, triage, *, run_config=None, streamed: bool = False, hooks=None):
    @lrl.trace
    async def solve(question):
        if streamed:
            result = agents.Runner.run_streamed(triage, question, max_turns=3, run_config=run_config, hooks=hooks)
            async for _ in result.stream_events():
                pass
        else:
            await agents.Runner.run(triage, question, max_turns=3, run_config=run_config, hooks=hooks)
        return 1.0

    try:
        await solve(scenario.QUESTION)
    except agents.exceptions.AgentsException:
        pass  # a turn limit or the model's words: what was recorded is what is asserted


async def test_set_tracing_disabled_still_names_agents_and_records_tools(traced, vllm_url, agents, tracing_disabled):
    class ProgramHooks(agents.RunHooks):
        """The program's own run hooks: they still get every call, with the same arguments."""

        def __init__(self):
            self.calls = []

        async def on_llm_start(self, context, agent, system_prompt, input_items):
            self.calls.append(("llm", agent.name))

        async def on_handoff(self, context, from_agent, to_agent):
            self.calls.append(("handoff", from_agent.name, to_agent.name))

        async def on_tool_end(self, context, agent, tool, result):
            self.calls.append(("tool", tool.name, context.tool_call_id, result))

    hooks = ProgramHooks()
    await _run(agents, scenario.triage_agent(agents, vllm_url), hooks=hooks)
    (traj,) = lrl.trajectories(traced)
    _check_triage_to_tutor(traj)
    assert hooks.calls[:3] == [("llm", "triage"), ("handoff", "triage", "math tutor"), ("llm", "math tutor")]
    ended = [(s.attributes[semconv.GEN_AI_TOOL_CALL_ID], s.attributes[semconv.TOOL_RESULT])
             for s in _spans(traj, "calculator")]
    assert [call[2:] for call in hooks.calls if call[0] == "tool"] == ended


@pytest.mark.parametrize("handled", [True, False], ids=["the model told", "the run ended"])
async def test_a_failing_tool_is_an_error_span_with_tracing_disabled(traced, vllm_url, agents, tracing_disabled,
                                                                     handled):
    """A tool that raises: the SDK tells the model its failure message (the default), or, with no
    ``failure_error_function``, ends the run with the error. Either way the span is an error with the call id."""

    def calculator(expression: Annotated[str, Field(pattern=scenario.PATTERN)]) -> str:
        """Evaluate an arithmetic expression."""
        raise ValueError(f"no calculator today for {expression}")

    broken = agents.function_tool(calculator, **({} if handled else {"failure_error_function": None}))
    await _run(agents, scenario.triage_agent(agents, vllm_url, tools=[broken]))
    (traj,) = lrl.trajectories(traced)
    asked = [tc.id for call in traj.llm_calls for tc in call.tool_calls if tc.name == "calculator"]
    spans = _spans(traj, "calculator")
    assert [s.attributes[semconv.GEN_AI_TOOL_CALL_ID] for s in spans] == asked[:len(spans)] and spans
    for span in spans:
        assert span.status_code == "ERROR" and "ValueError: no calculator today for" in span.status_message
        assert span.attributes[semconv.GEN_AI_AGENT_NAME] == "math tutor"
    if handled:  # the model was told, and the span says what it was told
        assert spans[0].attributes[semconv.TOOL_RESULT].startswith("An error occurred while running the tool")
    else:
        assert len(spans) == 1 and lrl.stats().get("openai-agents tool span", 0) == 0


async def test_run_config_tracing_disabled_streamed_still_names_agents_and_records_tools(traced, vllm_url, agents):
    await _run(agents, scenario.triage_agent(agents, vllm_url), run_config=agents.RunConfig(tracing_disabled=True),
               streamed=True)
    (traj,) = lrl.trajectories(traced)
    _check_triage_to_tutor(traj)


def test_env_disable_tracing_still_names_agents_and_records_tools(vllm_url, tmp_path):
    """``OPENAI_AGENTS_DISABLE_TRACING=1`` is read once per process: a fresh one, ``Runner.run_sync``."""
    pytest.importorskip("agents")
    env = {**__import__("os").environ, "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    result = subprocess.run([sys.executable, "agents_sdk_scenario.py", vllm_url, str(tmp_path / "off.db")], env=env,
                            capture_output=True, text=True, timeout=300, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]
    store = SQLiteStore(tmp_path / "off.db")
    try:
        (traj,) = lrl.trajectories(store)
        _check_triage_to_tutor(traj)
    finally:
        store.close()


class _SpansSeen:
    """A trace processor of the program's own: the SDK's spans still reach it while lightning-rl records."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def on_trace_start(self, trace) -> None:
        pass

    def on_trace_end(self, trace) -> None:
        pass

    def on_span_start(self, span) -> None:
        pass

    def on_span_end(self, span) -> None:
        self.kinds.append(getattr(span.span_data, "type", "?"))

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


async def test_tracing_on_records_once_and_the_programs_own_processor_still_gets_its_spans(traced, vllm_url, agents):
    seen = _SpansSeen()
    agents.add_trace_processor(seen)
    await _run(agents, scenario.triage_agent(agents, vllm_url))
    (traj,) = lrl.trajectories(traced)
    _check_triage_to_tutor(traj)  # one span per tool call: the SDK's tracing adds none of its own
    assert {"agent", "function", "handoff"} <= set(seen.kinds), seen.kinds


async def test_an_mcp_tool_the_sdk_runs_is_one_tool_span_with_the_models_call_id(traced, vllm_url, agents):
    """``agents.mcp.MCPServerStdio``: the SDK's MCP tool is its function tool; the MCP client session underneath
    records no second span for the same call."""
    pytest.importorskip("mcp")
    from agents.mcp import MCPServerStdio

    params = {"command": sys.executable, "args": [str(HERE / "agents_mcp_server.py")]}
    async with MCPServerStdio(params=params, name="calculator server", cache_tools_list=True) as server:
        await _run(agents, scenario.triage_agent(agents, vllm_url, mcp_servers=[server]))
    (traj,) = lrl.trajectories(traced)
    _check_triage_to_tutor(traj, result_of=lambda result: json.loads(result)["text"])  # the SDK's text of MCP content
    assert all(s.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) for s in traj.tool_spans)


# -- PydanticAI: its instrumentation (OpenTelemetry, logfire) is the program's choice ---------------------------
@pytest.fixture
def pydantic_ai():
    pydantic_ai = pytest.importorskip("pydantic_ai")
    previous = pydantic_ai.Agent._instrument_default
    yield pydantic_ai
    pydantic_ai.Agent.instrument_all(previous)


@pytest.mark.parametrize("setting", ["agent.instrument = False", "the program's own instrument_all"])
async def test_pydantic_ai_names_and_tools_whatever_its_instrumentation(traced, vllm_url, pydantic_ai, setting):
    """An agent the program keeps uninstrumented, or instrumented to its own provider (what
    ``logfire.instrument_pydantic_ai()`` does): each call still carries the agent's name and each tool call is one
    tool span with the model's call id; the program's provider still gets PydanticAI's own spans."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from pydantic_ai.models.instrumented import InstrumentationSettings
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    theirs = InMemorySpanExporter()
    if setting == "the program's own instrument_all":
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(theirs))
        pydantic_ai.Agent.instrument_all(InstrumentationSettings(tracer_provider=provider))
    model = OpenAIChatModel(scenario.SERVED_NAME, provider=OpenAIProvider(base_url=vllm_url, api_key="EMPTY"))
    force = {"tool_choice": {"type": "function", "function": {"name": "calculator"}}}
    agent = pydantic_ai.Agent(model, name="calc agent", instructions="Use the calculator.",
                              model_settings=pydantic_ai.ModelSettings(temperature=0, max_tokens=200, extra_body=force))
    if setting == "agent.instrument = False":
        agent.instrument = False

    @agent.tool_plain
    def calculator(expression: Annotated[str, Field(pattern=scenario.PATTERN)]) -> str:
        """Evaluate an arithmetic expression."""
        return scenario.add(expression)

    @lrl.trace
    async def solve(question):
        await agent.run(question, usage_limits=UsageLimits(request_limit=2))  # forced every turn: the limit ends it
        return 1.0

    with pytest.raises(pydantic_ai.exceptions.UsageLimitExceeded):
        await solve(scenario.QUESTION)
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    assert {c.agent_name for c in traj.llm_calls} == {"calc agent"}
    asked = [tc.id for call in traj.llm_calls for tc in call.tool_calls]
    spans = _spans(traj, "calculator")
    assert [s.attributes[semconv.GEN_AI_TOOL_CALL_ID] for s in spans] == asked and len(asked) == len(traj.llm_calls)
    for span in spans:
        arguments = json.loads(span.attributes[semconv.TOOL_ARGUMENTS])
        assert span.attributes[semconv.TOOL_RESULT] == scenario.add(arguments["expression"])
        assert span.attributes[semconv.GEN_AI_AGENT_NAME] == "calc agent"
    if setting == "the program's own instrument_all":
        assert any(s.name == "execute_tool calculator" for s in theirs.get_finished_spans())
