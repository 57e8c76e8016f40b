"""Zero-code LangChain / LangGraph tracing against the real vLLM server (real LangChain objects).

No test depends on what the tiny model happens to say. Where a test needs a tool call, the engine is
made to produce one: a named ``tool_choice`` with a ``strict`` schema (vLLM then constrains the call
with a structural tag), and the tool's argument is a pattern, so it is short and always valid. Where a
test is about capture (a free-running agent), it asserts what was recorded whether the agent returned
or raised, and that the rollout's status says which.
"""

from __future__ import annotations

import uuid
from typing import Annotated, TypedDict

import pytest
from pydantic import BaseModel, Field

import lightning_rl as lrl

pytestmark = pytest.mark.vllm

langchain_openai = pytest.importorskip("langchain_openai")
from langchain.agents import create_agent  # noqa: E402
from langchain.agents.middleware import wrap_model_call  # noqa: E402
from langchain_core.messages import AIMessage, AnyMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.graph.message import add_messages  # noqa: E402
from langgraph.prebuilt import ToolNode  # noqa: E402

QUESTION = "What is 12+30?"


class CalculatorArgs(BaseModel):
    expression: str = Field(description="two numbers and a plus, e.g. 12+30", pattern=r"^[0-9]{1,3}[+][0-9]{1,3}$")


@tool(args_schema=CalculatorArgs)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 (digits and + only in these tests)
    except Exception as exc:  # the model may write anything
        return f"error: {exc}"


@pytest.fixture
def llm(vllm_url):
    return langchain_openai.ChatOpenAI(model="tiny", base_url=vllm_url, api_key="EMPTY", max_tokens=120, temperature=0.0)


def _spans(store, rollout_id):
    return {s.span_id: s for s in store.spans(rollout_id)}


def _outcome(agent, *args):
    """Run a traced agent that runs free: None when it returned, else what it raised."""
    try:
        agent(*args)
    except Exception as exc:
        return exc
    return None


def _assert_status(t, outcome):
    """The rollout says how the agent ended: succeeded when it returned, failed with the error when it raised."""
    if outcome is None:
        assert t.status == "succeeded", t.error
    else:
        assert t.status == "failed" and type(outcome).__name__ in t.error


@wrap_model_call
def strict_tools(request, handler):
    """Bind the agent's tools with ``strict``: a call the model makes always matches the tool's schema."""
    return handler(request.override(model_settings={**request.model_settings, "strict": True}))


def _assert_engine_ids(t, tokenizer):
    assert t.llm_calls, "empty trajectory"
    for c in t.llm_calls:
        assert c.token_ids_source == "engine" and c.prompt_token_ids and c.response_token_ids
        assert len(c.response_logprobs) == len(c.response_token_ids)


def test_create_agent_spans_parents_agent_names_and_token_ids(traced, llm, tokenizer):
    agent = create_agent(llm, tools=[calculator], name="math_agent", middleware=[strict_tools])

    @lrl.trace
    def run(question):  # the model decides whether and how often to call the tool: it may hit the limit
        agent.invoke({"messages": [{"role": "user", "content": question}]}, {"recursion_limit": 8})
        return 1.0

    outcome = _outcome(run, QUESTION)
    (t,) = list(lrl.trajectories(traced))
    _assert_status(t, outcome)
    _assert_engine_ids(t, tokenizer)
    assert {c.agent_name for c in t.llm_calls} == {"math_agent"}
    spans = _spans(traced, t.rollout_id)
    root = next(s for s in spans.values() if s.parent_id is None)
    agent_span = next(s for s in spans.values() if s.name == "invoke_agent math_agent")
    assert agent_span.parent_id == root.span_id
    for c in t.llm_calls:
        node = spans[c.parent_id]
        assert node.name == "model" and node.parent_id == agent_span.span_id
        assert spans[c.span_id].attributes["lightning_rl.framework.run_id"]
    # what was recorded is exactly what the engine saw
    first = t.llm_calls[0]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"properties": {"expression": {}}}}}]
    expected = tokenizer.apply_chat_template(first.input_messages, tools=tools, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert first.prompt_token_ids == list(expected)


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def _graph(llm):
    planner = llm.bind_tools([calculator], tool_choice="calculator", strict=True)  # exactly one valid call

    def plan(state: State):
        return {"messages": [planner.invoke(state["messages"])]}

    def answer(state: State):
        return {"messages": [llm.invoke(state["messages"])]}

    g = StateGraph(State)
    g.add_node("planner", plan)
    g.add_node("tools", ToolNode([calculator]))
    g.add_node("answer", answer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "tools")
    g.add_edge("tools", "answer")
    g.add_edge("answer", END)
    return g.compile()


def test_langgraph_graph_with_tool_node(traced, llm, tokenizer):
    graph = _graph(llm)

    @lrl.trace
    def run(question):
        out = graph.invoke({"messages": [{"role": "user", "content": question}]})
        return 1.0 if "42" in out["messages"][-1].content else 0.0

    run(QUESTION)
    (t,) = list(lrl.trajectories(traced))
    _assert_engine_ids(t, tokenizer)
    assert [c.agent_name for c in t.llm_calls] == ["planner", "answer"]  # LangGraph node names
    (tool_call,) = t.llm_calls[0].tool_calls
    assert tool_call.name == "calculator"
    (tool_span,) = t.tool_spans
    spans = _spans(traced, t.rollout_id)
    assert tool_span.attributes["gen_ai.tool.name"] == "calculator"
    assert tool_span.attributes["gen_ai.tool.call.id"] == tool_call.id
    assert tool_span.attributes["gen_ai.tool.call.arguments"]
    assert "gen_ai.tool.call.result" in tool_span.attributes
    assert spans[tool_span.parent_id].name == "tools"
    assert [spans[c.parent_id].name for c in t.llm_calls] == ["planner", "answer"]
    workflow = next(s for s in spans.values() if s.name.startswith("invoke_workflow"))
    assert spans[workflow.parent_id].parent_id is None  # graph under the rollout root


async def test_streaming_and_async_graph_keep_token_ids(traced, vllm_url, tokenizer):
    streaming = langchain_openai.ChatOpenAI(model="tiny", base_url=vllm_url, api_key="EMPTY", max_tokens=120,
                                            temperature=0.0, streaming=True)
    graph = _graph(streaming)

    @lrl.trace
    async def run(question):
        await graph.ainvoke({"messages": [{"role": "user", "content": question}]})
        return 1.0

    await run(QUESTION)
    (t,) = list(lrl.trajectories(traced))
    _assert_engine_ids(t, tokenizer)
    assert all(c.streamed for c in t.llm_calls)
    assert [c.agent_name for c in t.llm_calls] == ["planner", "answer"]
    assert len(t.tool_spans) == 1


class Verdict(BaseModel):
    correct: bool


def test_structured_output_is_not_an_empty_trajectory(traced, llm, tokenizer):
    # A strict JSON schema: vLLM constrains the whole answer, and the test server writes constrained JSON
    # without free whitespace (VLLMServer), so the only choice left is true or false. (With the function-
    # calling method, the structural tag's grammar lets the tiny model pad the call with spaces up to
    # max_tokens, which one build of it did.)
    structured = llm.with_structured_output(Verdict, method="json_schema", include_raw=True, strict=True)

    @lrl.trace
    def run(question):
        out = structured.invoke(question)
        assert isinstance(out["parsed"], Verdict), out
        return 1.0

    outcome = _outcome(run, QUESTION)
    assert outcome is None, outcome
    (t,) = list(lrl.trajectories(traced))
    _assert_status(t, outcome)
    _assert_engine_ids(t, tokenizer)
    (call,) = t.llm_calls
    assert call.finish_reason == "stop" and call.output_messages[0]["content"] in ('{"correct":true}',
                                                                                 '{"correct":false}')
    assert t.final_reward == 1.0


def test_truncated_structured_output_keeps_its_tokens(traced, vllm_url):
    short = langchain_openai.ChatOpenAI(model="tiny", base_url=vllm_url, api_key="EMPTY", max_tokens=3)
    structured = short.with_structured_output(Verdict, method="json_schema")

    @lrl.trace
    def run(question):
        structured.invoke(question)

    with pytest.raises(Exception, match="length limit"):
        run(QUESTION)
    (t,) = list(lrl.trajectories(traced))
    (call,) = t.llm_calls
    assert t.status == "failed" and call.token_ids_source == "engine" and len(call.response_token_ids) == 3


def test_nothing_recorded_outside_a_rollout(traced, llm):
    llm.invoke(QUESTION)
    assert traced.rollouts() == []


def test_handler_failures_never_reach_the_agent(traced, llm):
    from lightning_rl.adapters.langchain import instrument

    handler = instrument()

    class Hostile(dict):
        def get(self, *args):
            raise RuntimeError("metadata exploded")

    @lrl.trace
    def run(question):
        handler.on_chain_start({}, {}, run_id=uuid.uuid4(), metadata=Hostile(lc_agent_name="x"))
        handler.on_tool_end("x", run_id=uuid.uuid4())
        return 1.0 if isinstance(llm.invoke(question), AIMessage) else 0.0

    assert run(QUESTION) == 1.0
    assert lrl.stats()["langchain chain start"] == 1
    assert next(lrl.trajectories(traced)).llm_calls
