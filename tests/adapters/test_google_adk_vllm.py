"""Google ADK agents (``LlmAgent`` + ``Runner`` + ``InMemorySessionService``, as ADK's docs show) with ``@trace``
alone, against the real vLLM server, through ADK's ``LiteLlm("openai/<served name>", api_base=...)`` (issue 45).
ADK pins OpenTelemetry <= 1.44 and the main environment has 1.45, so this file runs in its own environment
(``.venv-adk``, built and run by ``make test``); elsewhere it is skipped.

Tool use is forced: a named ``tool_choice`` given to ``LiteLlm``, or ADK's own ``FunctionCallingConfig(mode=
"ANY")``, which reaches vLLM as ``tool_choice="required"``. ADK's ``LiteLlm`` never marks a tool ``strict``, so vLLM
constrains the call's envelope but not its arguments (any JSON object): with the quote token banned and free
whitespace pushed down (``conftest.no_free_whitespace``: JSON lets a greedy model pad ``{ }`` with spaces until
``max_tokens``, and a truncated call is no call: a sub-agent's call once ended so, "no calculator span") the only
object the model can write is ``{}``, so every forced call closes, and the tools take defaults. (The arguments
of a call are checked with ADK's own scripted path, a ``before_model_callback`` answering for the model, in the
test that needs no server.) ``RunConfig(max_llm_calls=...)`` ends the run (a forced tool never lets the agent
answer); what is asserted is what was recorded, whether the run returned or raised."""

# No `from __future__ import annotations`: ADK builds its tools' schemas from the functions' annotations.
import importlib.util
import json

import pytest

import lightning_rl as lrl
from lightning_rl import semconv

from ..conftest import MODEL_DIR, SERVED_NAME, no_free_whitespace

if importlib.util.find_spec("google.adk") is None:
    pytest.skip("Google ADK lives in .venv-adk (make venv-adk; make test runs this file there)",
                allow_module_level=True)  # before the vLLM server is started for nothing


def _no_quotes() -> dict[str, int]:
    """The tiny model's tokens holding a double quote, banned: a JSON object without one is ``{}``."""
    path = MODEL_DIR / "tokenizer.json"
    if not path.is_file():
        return {}  # no model yet: the vLLM fixture builds it, and this module is imported before
    vocab = json.loads(path.read_text())["model"]["vocab"]
    return {str(i): -100 for token, i in vocab.items() if '"' in token}


NO_QUOTES = _no_quotes()


def _answer(expression) -> str:
    """What the tool returns: a pure function of its argument, whatever the model wrote."""
    expression = str(expression)
    return f"{len(expression)}:{expression[::-1]}"


def calculator(expression: str = "12+30") -> str:
    """Evaluate an arithmetic expression."""
    return _answer(expression)


@pytest.fixture
def adk(vllm_url, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # nothing from the network
    from google.adk.agents import LlmAgent
    from google.adk.agents.run_config import RunConfig, StreamingMode
    from google.adk.models.lite_llm import LiteLlm
    from google.adk.runners import Runner
    from google.adk.sessions import InMemorySessionService
    from google.genai import types

    def model(tool: str | None = None) -> LiteLlm:
        force = {"tool_choice": {"type": "function", "function": {"name": tool}}} if tool else {}
        return LiteLlm(model=f"openai/{SERVED_NAME}", api_base=vllm_url, api_key="EMPTY", temperature=0,
                       max_tokens=120, logit_bias={**NO_QUOTES, **no_free_whitespace()}, **force)

    async def run(agent, question: str, *, max_llm_calls: int, stream: bool = False) -> None:
        sessions = InMemorySessionService()
        runner = Runner(agent=agent, app_name="lrl-test", session_service=sessions)
        session = await sessions.create_session(app_name="lrl-test", user_id="u")
        config = RunConfig(max_llm_calls=max_llm_calls,
                           streaming_mode=StreamingMode.SSE if stream else StreamingMode.NONE)
        message = types.Content(role="user", parts=[types.Part(text=question)])
        async for _ in runner.run_async(user_id="u", session_id=session.id, new_message=message, run_config=config):
            pass

    return LlmAgent, model, run, types


def _engine_served(traj) -> None:
    assert traj.llm_calls, "no LLM call recorded"
    for call in traj.llm_calls:
        assert call.token_ids_source == "engine" and call.prompt_token_ids and call.response_token_ids
        assert call.response_logprobs is not None and len(call.response_logprobs) == len(call.response_token_ids)


def _asked(traj) -> dict:
    return {tc.id: (call, tc) for call in traj.llm_calls for tc in call.tool_calls}


def _spans(traj, tool: str) -> list:
    return [s for s in traj.tool_spans if s.attributes[semconv.GEN_AI_TOOL_NAME] == tool]


def _calculator_spans_match(traj, agent: str) -> None:
    """Each calculator span answers one of the agent's own tool calls: same id, same arguments, its result."""
    asked = _asked(traj)
    spans = _spans(traj, "calculator")
    assert spans, "no calculator span"
    for span in spans:
        call, tool_call = asked[span.attributes[semconv.GEN_AI_TOOL_CALL_ID]]  # the model's own call id
        assert call.agent_name == agent and span.attributes[semconv.GEN_AI_AGENT_NAME] == agent
        arguments = json.loads(span.attributes[semconv.TOOL_ARGUMENTS])
        assert arguments == json.loads(tool_call.arguments)
        assert span.attributes[semconv.TOOL_RESULT] == _answer(arguments.get("expression", "12+30"))
        assert span.status_code != "ERROR"


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_adk_agent_calls_names_and_tool_spans(traced, adk, stream):
    LlmAgent, model, run, _ = adk
    tutor = LlmAgent(name="math_tutor", model=model("calculator"), instruction="Use the calculator.",
                     tools=[calculator])

    @lrl.trace
    async def solve(question):
        await run(tutor, question, max_llm_calls=2, stream=stream)
        return 1.0

    try:
        await solve("What is 12+30?")
    except Exception:
        pass  # the forced tool never lets it answer: the call limit
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    assert len(traj.llm_calls) == 2
    assert all(call.streamed == stream for call in traj.llm_calls)
    assert {c.agent_name for c in traj.llm_calls} == {"math_tutor"}  # ADK's agent, not the traced function
    _calculator_spans_match(traj, "math_tutor")


def hand_over(tool_context) -> str:
    """Hand arithmetic to math_tutor."""
    tool_context.actions.transfer_to_agent = "math_tutor"  # what ADK's transfer_to_agent tool does
    return "handed over"


@pytest.mark.vllm
async def test_adk_transfer_names_the_sub_agents_calls(traced, adk):
    """A transfer to a sub-agent (``EventActions.transfer_to_agent``, set by a tool without arguments: ADK's own
    ``transfer_to_agent`` needs a name, which the quote-less model cannot write): its calls carry its name."""
    LlmAgent, model, run, _ = adk
    from google.adk.tools import FunctionTool

    tutor = LlmAgent(name="math_tutor", description="Does arithmetic.", model=model("calculator"),
                     instruction="Use the calculator.", tools=[calculator])
    triage = LlmAgent(name="triage", model=model("hand_over"), instruction="Hand arithmetic to math_tutor.",
                      tools=[FunctionTool(hand_over)], sub_agents=[tutor])

    @lrl.trace
    async def solve(question):
        await run(triage, question, max_llm_calls=3)
        return 1.0

    try:
        await solve("What is 12+30?")
    except Exception:
        pass
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    names = [c.agent_name for c in traj.llm_calls]
    assert names[0] == "triage" and names[1:] and set(names[1:]) == {"math_tutor"}
    (transfer,) = _spans(traj, "hand_over")
    assert transfer.attributes[semconv.GEN_AI_TOOL_CALL_ID] == traj.llm_calls[0].tool_calls[0].id
    assert transfer.attributes[semconv.GEN_AI_AGENT_NAME] == "triage"
    assert transfer.attributes[semconv.TOOL_RESULT] == "handed over"
    _calculator_spans_match(traj, "math_tutor")


@pytest.mark.vllm
async def test_adk_single_turn_sub_agent_runs_as_a_tool_under_its_span(traced, adk):
    """ADK 2's recommended sub-agent (``mode="single_turn"``): the parent calls it as a tool; its calls carry
    its own name and are children of that tool's span."""
    LlmAgent, model, run, _ = adk
    from pydantic import BaseModel

    class Question(BaseModel):
        expression: str = "12+30"

    tutor = LlmAgent(name="math_tutor", description="Does arithmetic.", mode="single_turn", input_schema=Question,
                     model=model("calculator"), instruction="Use the calculator.", tools=[calculator])
    triage = LlmAgent(name="triage", model=model("math_tutor"), instruction="Ask math_tutor.", sub_agents=[tutor])

    @lrl.trace
    async def solve(question):
        await run(triage, question, max_llm_calls=3)
        return 1.0

    try:
        await solve("What is 12+30?")
    except Exception:
        pass
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    names = [c.agent_name for c in traj.llm_calls]
    assert names[0] == "triage" and "math_tutor" in names
    (as_tool, *_) = _spans(traj, "math_tutor")
    assert as_tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == traj.llm_calls[0].tool_calls[0].id
    assert as_tool.attributes[semconv.GEN_AI_AGENT_NAME] == "triage"
    inside = [c for c in traj.llm_calls if as_tool.start_ns <= c.start_ns and c.end_ns <= as_tool.end_ns]
    assert inside and {c.agent_name for c in inside} == {"math_tutor"}
    _calculator_spans_match(traj, "math_tutor")


@pytest.mark.vllm
async def test_adk_tool_that_raises_is_an_error_span(traced, adk):
    """ADK's own forcing (``mode="ANY"``, sent as ``tool_choice="required"``); the tool raises, ADK raises it out
    of the run: the span carries the error and the model's call id, and the rollout fails with it."""
    LlmAgent, model, run, types = adk

    def calculator(expression: str = "12+30") -> str:
        """Evaluate an arithmetic expression."""
        raise ValueError(f"calculator is broken for {expression}")

    forced = types.GenerateContentConfig(tool_config=types.ToolConfig(
        function_calling_config=types.FunctionCallingConfig(mode="ANY")))
    tutor = LlmAgent(name="math_tutor", model=model(), instruction="Use the calculator.", tools=[calculator],
                     generate_content_config=forced)

    @lrl.trace
    async def solve(question):
        await run(tutor, question, max_llm_calls=2)
        return 1.0

    with pytest.raises(ValueError, match="calculator is broken"):
        await solve("What is 12+30?")
    (traj,) = lrl.trajectories(traced)
    _engine_served(traj)
    assert traj.status == "failed" and "calculator is broken" in (traj.error or "")
    assert traj.llm_calls[0].agent_name == "math_tutor"
    (span,) = _spans(traj, "calculator")
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_ID] == traj.llm_calls[0].tool_calls[0].id
    assert span.attributes[semconv.GEN_AI_AGENT_NAME] == "math_tutor"
    assert span.status_code == "ERROR" and "calculator is broken" in (span.status_message or "")
    assert semconv.TOOL_RESULT not in span.attributes


async def test_adk_tool_span_has_the_calls_arguments_without_a_server(traced):
    """ADK's scripted path (a ``before_model_callback`` answers for the model, so no LLM is called): the tool span
    carries the call's own arguments, ADK's call id and the tool's result, and the agent's name."""
    from google.adk.agents import LlmAgent
    from google.adk.models.llm_response import LlmResponse
    from google.adk.runners import Runner
    from google.adk.sessions import InMemorySessionService
    from google.genai import types

    def script(callback_context, llm_request):
        if any(p.function_response for c in llm_request.contents for p in (c.parts or [])):
            return LlmResponse(content=types.Content(role="model", parts=[types.Part(text="done")]))
        call = types.FunctionCall(id="call-7", name="calculator", args={"expression": "7+5"})
        return LlmResponse(content=types.Content(role="model", parts=[types.Part(function_call=call)]))

    tutor = LlmAgent(name="math_tutor", model="gemini-2.5-flash", tools=[calculator], before_model_callback=script)

    @lrl.trace
    async def solve(question):
        sessions = InMemorySessionService()
        runner = Runner(agent=tutor, app_name="lrl-test", session_service=sessions)
        session = await sessions.create_session(app_name="lrl-test", user_id="u")
        message = types.Content(role="user", parts=[types.Part(text=question)])
        async for _ in runner.run_async(user_id="u", session_id=session.id, new_message=message):
            pass
        return 1.0

    await solve("What is 7+5?")
    (traj,) = lrl.trajectories(traced)
    (span,) = traj.tool_spans
    assert span.name == "execute_tool calculator"
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call-7"
    assert json.loads(span.attributes[semconv.TOOL_ARGUMENTS]) == {"expression": "7+5"}
    assert span.attributes[semconv.TOOL_RESULT] == _answer("7+5")
    assert span.attributes[semconv.GEN_AI_AGENT_NAME] == "math_tutor"  # ADK's agent, not the traced function
