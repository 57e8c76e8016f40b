"""CrewAI and LlamaIndex agents with ``@trace`` alone, against the real vLLM server (issue 32). Both pin
openai < 3, so this file runs in their own environment (``.venv-frameworks``, built and run by ``make
test``); in the main one it is skipped.

Tool use is forced: the framework's strict tool (vLLM constrains a named, strict tool call) whose argument
has a pattern, whitespace tokens banned (so the constrained call always closes within ``max_tokens``), and a
named ``tool_choice`` sent in ``extra_body`` (neither framework lets an agent name its tool choice), so no test
depends on what the tiny model says. What is asserted is what was recorded, whether the agent returned or
raised (the forced tool never lets it finish)."""

# No `from __future__ import annotations`: the frameworks build their tools' schemas from the functions'
# annotations in their own modules, where a string "Annotated[str, Field(...)]" cannot be resolved.
import importlib.util
import json
from typing import Annotated

import pytest
from pydantic import Field

import lightning_rl as lrl
from lightning_rl import semconv

from ..conftest import SERVED_NAME, no_free_whitespace

if importlib.util.find_spec("crewai") is None or importlib.util.find_spec("llama_index") is None:
    pytest.skip("CrewAI and LlamaIndex live in .venv-frameworks (make venv-frameworks; make test runs this file there)",
                allow_module_level=True)  # before the vLLM server is started for nothing
pytestmark = [pytest.mark.vllm]


FORCE = {"tool_choice": {"type": "function", "function": {"name": "calculator"}}, "logit_bias": no_free_whitespace()}
PATTERN = "^[0-9]{1,3}[+][0-9]{1,3}$"  # a bounded argument: the constrained call always closes


def _answer(expression: str) -> str:
    """What the tool returns: a pure function of its argument, whatever the model wrote."""
    expression = str(expression)
    return f"{len(expression)}:{expression[::-1]}"


def _check(traj, agent: str, *, min_tool_spans: int) -> None:
    assert traj.llm_calls, "no LLM call recorded"
    served = [c for c in traj.llm_calls if c.response_token_ids]
    assert served, "no call with the engine's ids"
    for call in served:
        assert call.token_ids_source == "engine" and call.prompt_token_ids
        assert call.response_logprobs is not None and len(call.response_logprobs) == len(call.response_token_ids)
    assert {c.agent_name for c in traj.llm_calls} == {agent}  # the framework's agent, not the traced function
    asked = {tc.id: tc for call in traj.llm_calls for tc in call.tool_calls}
    spans = [s for s in traj.tool_spans if s.attributes[semconv.GEN_AI_TOOL_NAME] == "calculator"]
    checked = 0
    for span in spans:
        call_id = span.attributes[semconv.GEN_AI_TOOL_CALL_ID]
        assert call_id in asked  # the model's own call, linked
        assert span.attributes[semconv.GEN_AI_AGENT_NAME] == agent
        try:
            asked_arguments = json.loads(asked[call_id].arguments)
        except ValueError:  # a later turn vLLM did not hold to the schema: linked, not compared
            continue
        arguments = json.loads(span.attributes[semconv.TOOL_ARGUMENTS])
        assert arguments == asked_arguments
        assert span.attributes[semconv.TOOL_RESULT] == _answer(arguments["expression"])
        checked += 1
    assert checked >= min_tool_spans


# -- CrewAI ----------------------------------------------------------------------------------------------
@pytest.fixture
def crewai(monkeypatch):
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # what CrewAI's docs say; capture must not care
    import crewai

    return crewai


@pytest.mark.parametrize("standalone", [False, True])
def test_crewai_roles_calls_and_tools(traced, vllm_url, crewai, standalone):
    from crewai.tools import tool

    @tool("calculator")
    def calculator(expression: Annotated[str, Field(pattern=PATTERN)]) -> str:
        """Evaluate an arithmetic expression like 12+30."""
        return _answer(expression)

    llm = crewai.LLM(model=f"openai/{SERVED_NAME}", base_url=vllm_url, api_key="EMPTY", temperature=0,
                     max_tokens=200, extra_body=FORCE)
    tutor = crewai.Agent(role="math tutor", goal="Answer arithmetic questions", backstory="Uses the calculator.",
                         llm=llm, tools=[calculator], max_iter=2, verbose=False)

    @lrl.trace
    def solve(question):
        if standalone:
            tutor.kickoff(question)
        else:
            task = crewai.Task(description=question, expected_output="a number", agent=tutor)
            crewai.Crew(agents=[tutor], tasks=[task]).kickoff()
        return 1.0

    try:
        solve("What is 12+30?")
    except Exception:
        pass  # the forced tool never lets it answer: the iteration limit
    (traj,) = lrl.trajectories(traced)
    _check(traj, "math tutor", min_tool_spans=1)  # recorded with OTEL_SDK_DISABLED=true set (the fixture)


# -- LlamaIndex ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["FunctionAgent", "AgentWorkflow"])
async def test_llamaindex_agent_names_calls_and_tools(traced, vllm_url, kind):
    from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent
    from llama_index.llms.openai_like import OpenAILike

    def calculator(expression: Annotated[str, Field(pattern=PATTERN)]) -> str:
        """Evaluate an arithmetic expression like 12+30."""
        return _answer(expression)

    llm = OpenAILike(model=SERVED_NAME, api_base=vllm_url, api_key="EMPTY", is_chat_model=True,
                     is_function_calling_model=True, temperature=0, max_tokens=200, strict=True,
                     additional_kwargs={"extra_body": FORCE})
    agent = FunctionAgent(name="calc agent", description="Does arithmetic.", system_prompt="Use the calculator.",
                          tools=[calculator], llm=llm)
    runner = agent if kind == "FunctionAgent" else AgentWorkflow(agents=[agent], root_agent="calc agent")

    @lrl.trace
    async def solve(question):
        await runner.run(question, max_iterations=3)
        return 1.0

    try:
        await solve("What is 12+30?")
    except Exception:
        pass  # the forced tool never lets it answer: the iteration limit
    (traj,) = lrl.trajectories(traced)
    _check(traj, "calc agent", min_tool_spans=1)
