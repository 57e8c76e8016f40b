"""The frameworks people build agents with now, with ``@trace`` alone, against the real vLLM server (issue 32):
every LLM call the engine served is recorded with its token ids and log-probs, the framework's own agent
name is on each call, and each tool call is a tool span with its call id, arguments and result. Tool use
is forced (a named tool choice with a bounded pattern: guided decoding), and what is asserted is what was
recorded whether the agent returned or raised."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
from pydantic import Field

import lightning_rl as lrl
from lightning_rl import semconv

from ..conftest import SERVED_NAME, no_free_whitespace

pytestmark = [pytest.mark.vllm]
PATTERN = "^[0-9]{1,3}[+][0-9]{1,3}$"
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string", "pattern": PATTERN}},
          "required": ["expression"], "additionalProperties": False}


def _add(expression: str) -> str:
    a, b = expression.split("+")
    return str(int(a) + int(b))


def _engine_served(traj) -> None:
    assert traj.llm_calls, "no LLM call recorded"
    for call in traj.llm_calls:
        assert call.token_ids_source == "engine" and call.response_token_ids and call.prompt_token_ids
        assert call.response_logprobs is not None and len(call.response_logprobs) == len(call.response_token_ids)


def _tool_spans_match_calls(traj, tool: str = "calculator") -> list:
    """Each tool span of ``tool`` answers one of the model's tool calls: same id, same arguments."""
    asked = {tc.id: tc for call in traj.llm_calls for tc in call.tool_calls if tc.name == tool}
    spans = [s for s in traj.tool_spans if s.attributes[semconv.GEN_AI_TOOL_NAME] == tool]
    assert spans, "no tool span"
    for span in spans:
        call_id = span.attributes[semconv.GEN_AI_TOOL_CALL_ID]
        assert call_id in asked
        arguments = json.loads(span.attributes[semconv.TOOL_ARGUMENTS])
        assert arguments == json.loads(asked[call_id].arguments)
        assert span.attributes[semconv.TOOL_RESULT] == _add(arguments["expression"])
    return spans


# -- the OpenAI Agents SDK -------------------------------------------------------------------------------
@pytest.fixture
def agents_sdk(vllm_url):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)

    async def invoke(ctx, args: str) -> str:
        return _add(json.loads(args)["expression"])

    calculator = agents.FunctionTool(name="calculator", description="Evaluate an arithmetic expression.",
                                     params_json_schema=SCHEMA, on_invoke_tool=invoke, strict_json_schema=True)
    return agents, client, calculator


@pytest.mark.parametrize("api", ["responses (the default)", "chat completions"])
async def test_openai_agents_sdk_calls_names_and_tools(traced, agents_sdk, api):
    agents, client, calculator = agents_sdk
    model = SERVED_NAME if api.startswith("responses") else agents.OpenAIChatCompletionsModel(
        model=SERVED_NAME, openai_client=client)
    settings = agents.ModelSettings(tool_choice="calculator", temperature=0, max_tokens=200)
    tutor = agents.Agent(name="math tutor", instructions="Use the calculator.", model=model, tools=[calculator],
                         model_settings=settings)

    @lrl.trace
    async def solve(question):
        result = await agents.Runner.run(tutor, question, max_turns=3)
        return 1.0 if result.final_output else 0.0

    try:
        await solve("What is 12+30?")
    except agents.exceptions.AgentsException:
        pass  # a turn limit or the model's words: what was recorded is what is asserted
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    assert {c.agent_name for c in traj.llm_calls} == {"math tutor"}  # the SDK's agent, not the traced function
    _tool_spans_match_calls(traj)


async def test_openai_agents_sdk_handoff_names_each_agent(traced, agents_sdk):
    agents, client, calculator = agents_sdk
    tutor = agents.Agent(name="math tutor", instructions="Use the calculator.", model=SERVED_NAME, tools=[calculator],
                         model_settings=agents.ModelSettings(tool_choice="calculator", temperature=0, max_tokens=200))
    triage = agents.Agent(name="triage", instructions="Hand arithmetic to the math tutor.", model=SERVED_NAME,
                          handoffs=[tutor], model_settings=agents.ModelSettings(
                              tool_choice="transfer_to_math_tutor", temperature=0, max_tokens=200))

    @lrl.trace
    async def solve(question):
        await agents.Runner.run(triage, question, max_turns=3)
        return 1.0

    try:
        await solve("What is 12+30?")
    except agents.exceptions.AgentsException:
        pass
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    assert [c.agent_name for c in traj.llm_calls][:2] == ["triage", "math tutor"]
    handoff = [s for s in traj.tool_spans if s.attributes[semconv.GEN_AI_TOOL_NAME] == "transfer_to_math_tutor"]
    (span,) = handoff
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_ID] == traj.llm_calls[0].tool_calls[0].id
    assert span.attributes[semconv.GEN_AI_AGENT_NAME] == "triage"
    _tool_spans_match_calls(traj)


# -- PydanticAI ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("streamed", [False, True])
async def test_pydantic_ai_calls_names_and_tools(traced, vllm_url, streamed):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    model = OpenAIChatModel(SERVED_NAME, provider=OpenAIProvider(base_url=vllm_url, api_key="EMPTY"))
    force = {"tool_choice": {"type": "function", "function": {"name": "calculator"}}}
    agent = pydantic_ai.Agent(model, name="calc agent", instructions="Use the calculator.",
                              model_settings=pydantic_ai.ModelSettings(temperature=0, max_tokens=200, extra_body=force))

    @agent.tool_plain
    def calculator(expression: Annotated[str, Field(pattern=PATTERN)]) -> str:
        """Evaluate an arithmetic expression."""
        return _add(expression)

    @lrl.trace
    async def solve(question):
        limits = UsageLimits(request_limit=2)  # the tool is forced every turn: two turns, then the limit
        if streamed:
            async with agent.run_stream(question, usage_limits=limits) as run:
                await run.get_output()
        else:
            await agent.run(question, usage_limits=limits)
        return 1.0

    with pytest.raises(pydantic_ai.exceptions.UsageLimitExceeded):
        await solve("What is 12+30?")
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    assert {c.agent_name for c in traj.llm_calls} == {"calc agent"}
    assert len(_tool_spans_match_calls(traj)) == len(traj.llm_calls)


# -- LiteLLM's hosted_vllm/ provider (its own HTTP handler, not the openai client) ------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_litellm_hosted_vllm_is_recorded_with_the_engines_ids(traced, vllm_url, monkeypatch, stream):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # nothing from the network
    litellm = pytest.importorskip("litellm")
    answers = []

    @lrl.trace
    def agent(question):
        response = litellm.completion(model=f"hosted_vllm/{SERVED_NAME}", api_base=vllm_url, temperature=0,
                                      max_tokens=8, messages=[{"role": "user", "content": question}], stream=stream)
        if stream:
            answers.append("".join(chunk.choices[0].delta.content or "" for chunk in response))
        else:
            answers.append(response.choices[0].message.content)
            assert response.choices[0].logprobs is None  # what the agent did not ask for is taken out again
        return 1.0

    agent("What is 12+30?")
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    (call,) = traj.llm_calls
    assert call.streamed is stream and call.output_messages[0]["content"] == answers[0]
    assert lrl.stats()["llm_calls_captured_at_http_layer:httpx"] >= 1


# -- smolagents ------------------------------------------------------------------------------------------
@pytest.fixture
def smolagents_calculator():
    smolagents = pytest.importorskip("smolagents")

    class Calculator(smolagents.Tool):
        name = "calculator"
        description = "Evaluate an arithmetic expression."
        inputs = {"expression": {"type": "string", "description": "like 12+30", "pattern": PATTERN}}
        output_type = "string"

        def forward(self, expression: str) -> str:
            return _add(expression)

    return smolagents, Calculator()


def _short_prompt(agent):
    """smolagents' own system prompt is longer than the tiny model's 2,048-token context."""
    agent.prompt_templates["system_prompt"] = "Use your tools."
    return agent


def _smolagents_model(smolagents, vllm_url, tool: str, argument: str):
    """A model that must call ``tool``: the model's own kwargs override what smolagents sends, so the one tool
    it is offered has a strict schema (vLLM constrains a named, strict tool call; smolagents sends no
    ``strict``) and is the named tool choice, with no free whitespace (``no_free_whitespace``)."""
    schema = {"type": "object", "properties": {argument: {"type": "string", "pattern": PATTERN}},
              "required": [argument], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": tool, "description": "Use it.", "strict": True,
                                               "parameters": schema}}]
    force = {"type": "function", "function": {"name": tool}}
    return smolagents.OpenAIServerModel(model_id=SERVED_NAME, api_base=vllm_url, api_key="EMPTY", tools=tools,
                                        tool_choice=force, temperature=0, max_tokens=200,
                                        logit_bias=no_free_whitespace())


@pytest.mark.parametrize("stream", [False, True])
def test_smolagents_calls_names_and_tools(traced, vllm_url, smolagents_calculator, stream):
    smolagents, calculator = smolagents_calculator
    agent = _short_prompt(smolagents.ToolCallingAgent(
        tools=[calculator], model=_smolagents_model(smolagents, vllm_url, "calculator", "expression"), name="calc_agent",
        max_steps=2, verbosity_level=0))

    @lrl.trace
    def solve(question):
        if stream:
            for _ in agent.run(question, stream=True):
                pass
        else:
            agent.run(question)
        return 1.0

    try:
        solve("What is 12+30?")
    except Exception:
        pass  # the tool is forced every step: what was recorded is what is asserted
    (traj,) = lrl.trajectories(traced)
    tool_turns = [c for c in traj.llm_calls if c.tool_calls]
    assert len(tool_turns) >= 2  # max_steps, each forced to call the calculator (then its final-answer call)
    _engine_served(traj)
    assert {c.agent_name for c in traj.llm_calls} == {"calc_agent"}
    assert len(_tool_spans_match_calls(traj)) == 2
    assert {s.attributes[semconv.GEN_AI_AGENT_NAME] for s in traj.tool_spans} == {"calc_agent"}


def test_smolagents_managed_agent_names_its_own_calls(traced, vllm_url, smolagents_calculator):
    smolagents, calculator = smolagents_calculator
    helper = _short_prompt(smolagents.ToolCallingAgent(
        tools=[calculator], model=_smolagents_model(smolagents, vllm_url, "calculator", "expression"), name="calc_helper",
        description="Does arithmetic.", max_steps=1, verbosity_level=0))
    manager = _short_prompt(smolagents.ToolCallingAgent(
        tools=[], managed_agents=[helper], name="manager", max_steps=1,
        model=_smolagents_model(smolagents, vllm_url, "calc_helper", "task"), verbosity_level=0))

    @lrl.trace
    def solve(question):
        manager.run(question)
        return 1.0

    try:
        solve("What is 12+30?")
    except Exception:
        pass
    (traj,) = lrl.trajectories(traced)
    names = [c.agent_name for c in traj.llm_calls if c.tool_calls]
    assert names[:2] == ["manager", "calc_helper"]  # the manager hands over; the helper's call is its own
    assert traj.llm_calls[0].tool_calls[0].name == "calc_helper"
    _tool_spans_match_calls(traj)
