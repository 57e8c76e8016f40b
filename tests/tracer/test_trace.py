"""@trace, rollout context, rewards and the private provider, written to a real SQLite store."""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
import threading

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lightning_rl as lrl
from lightning_rl.tracer import tracing


def _only(store):
    rollouts = store.rollouts()
    assert len(rollouts) == 1, rollouts
    return rollouts[0]


def test_sync_rollout_records_task_reward_and_is_on_disk_when_call_returns(traced):
    @lrl.trace
    def agent(question):
        return 1.0

    assert agent("what is 2+2?") == 1.0
    # Durable before return: a second, independent connection sees it without any flush.
    other = lrl.SQLiteStore(traced.path)
    try:
        r = _only(other)
        assert (r.status, r.task, r.name) == (lrl.RolloutStatus.SUCCEEDED, "what is 2+2?", "agent")
        t = next(lrl.trajectories(other))
        assert t.final_reward == 1.0 and t.status == "succeeded"
    finally:
        other.close()


async def test_async_rollout_with_kwargs_task(traced):
    @lrl.trace(name="solver", agent="math")
    async def agent(question, *, hint=None):
        await asyncio.sleep(0)
        lrl.emit_reward(0.25, name="format")
        return 0.5

    assert await agent("q", hint="h") == 0.5
    r = _only(traced)
    assert (r.name, r.agent, r.task) == ("solver", "math", {"question": "q", "hint": "h"})
    names = {(x.name, x.value, x.source) for x in traced.rewards(r.rollout_id)}
    assert names == {("format", 0.25, "emitted"), ("reward", 0.5, "returned")}


def test_exception_marks_failed_and_reraises_keeping_earlier_data(traced):
    @lrl.trace
    def agent(task):
        lrl.emit_reward(0.1)
        raise KeyError("missing tool")

    with pytest.raises(KeyError, match="missing tool"):
        agent({"id": 7})
    r = _only(traced)
    assert r.status == "failed" and "KeyError" in r.error and "missing tool" in r.error
    assert [x.value for x in traced.rewards(r.rollout_id)] == [0.1]
    root = traced.spans(r.rollout_id)[0]
    assert root.status_code == "ERROR"


def test_timeout_error_marks_timed_out(traced):
    @lrl.trace
    def agent(task):
        raise TimeoutError("model too slow")

    with pytest.raises(TimeoutError):
        agent(1)
    assert _only(traced).status == "timed_out"


def test_nested_traced_calls_are_child_spans_of_one_rollout(traced):
    @lrl.trace(agent="helper")
    def helper(x):
        return 3.0  # a nested call's return value is not a reward

    @lrl.trace
    def agent(x):
        helper(x)
        return 1.0

    agent(1)
    r = _only(traced)
    spans = traced.spans(r.rollout_id)
    assert [s.name for s in spans] == ["invoke_agent agent", "invoke_agent helper"]
    assert spans[1].parent_id == spans[0].span_id
    assert [x.value for x in traced.rewards(r.rollout_id)] == [1.0]


def test_new_rollout_opt_out_makes_a_separate_rollout(traced):
    @lrl.trace(new_rollout=True)
    def inner(x):
        return 0.0

    @lrl.trace
    def outer(x):
        inner(x)
        return 1.0

    outer(1)
    assert len(traced.rollouts()) == 2


async def test_context_crosses_asyncio_tasks_and_copied_context_threads(traced):
    seen = []

    def in_thread():
        seen.append(lrl.current_rollout_id())

    @lrl.trace
    async def agent(x):
        rid = lrl.current_rollout_id()
        await asyncio.gather(*(asyncio.create_task(_record(seen)) for _ in range(3)))
        await asyncio.to_thread(in_thread)
        ctx = contextvars.copy_context()
        t = threading.Thread(target=ctx.run, args=(in_thread,))
        t.start()
        t.join()
        return rid

    rid = await agent(1)
    assert seen == [rid] * 5


async def _record(seen):
    await asyncio.sleep(0)
    seen.append(lrl.current_rollout_id())


async def test_concurrent_rollouts_do_not_mix(traced):
    @lrl.trace
    async def agent(i):
        await asyncio.sleep(0.01 * (i % 3))
        lrl.emit_reward(float(i))
        await asyncio.sleep(0)
        return float(i)

    await asyncio.gather(*(agent(i) for i in range(12)))
    rollouts = traced.rollouts()
    assert len(rollouts) == 12
    for r in rollouts:
        assert {x.value for x in traced.rewards(r.rollout_id)} == {float(r.task)}


def test_agent_scope_names_agent_and_opens_span(traced):
    @lrl.trace
    def agent(x):
        with lrl.agent_scope("planner"):
            from lightning_rl.tracer import current_agent_name

            assert current_agent_name() == "planner"
        return 1.0

    agent(1)
    spans = traced.spans(_only(traced).rollout_id)
    assert spans[1].name == "invoke_agent planner"
    assert spans[1].attributes["gen_ai.agent.name"] == "planner"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "0.5", None, True, [1.0]])
def test_emit_reward_rejects_bad_values_naming_them(traced, bad):
    @lrl.trace
    def agent(x):
        lrl.emit_reward(0.5)
        lrl.emit_reward(bad)

    with pytest.raises(ValueError) as info:
        agent(1)
    assert repr(bad)[:10] in str(info.value) or str(bad) in str(info.value)
    r = _only(traced)
    assert r.status == "failed"  # the agent raised; what was recorded before is kept
    assert [x.value for x in traced.rewards(r.rollout_id)] == [0.5]


def test_emit_reward_outside_rollout_raises_clear_error():
    with pytest.raises(lrl.NotInRolloutError, match="outside any rollout.*@lightning_rl.trace"):
        lrl.emit_reward(1.0)


def test_returned_nan_fails_rollout_and_raises(traced):
    @lrl.trace
    def agent(x):
        lrl.emit_reward(0.2)
        return math.nan

    with pytest.raises(lrl.InvalidRewardError, match="nan"):
        agent(1)
    r = _only(traced)
    assert r.status == "failed" and "nan" in r.error
    assert [x.value for x in traced.rewards(r.rollout_id)] == [0.2]


def test_arguments_json_cannot_hold_never_fail_the_call(traced):
    import openai

    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="EMPTY")
    before = lrl.stats().get("task_values_not_json", 0)

    @lrl.trace
    def solve(client, question, tags):
        return 1.0

    assert solve(client, "why?", {object(): 1}) == 1.0  # a dict key JSON cannot hold either
    assert solve(client, "why?", {object(): 1}) == 1.0
    first, second = traced.rollouts()
    assert first.task == {"client": "<openai.OpenAI>", "question": "why?", "tags": {"<builtins.object>": 1}}
    assert first.status == "succeeded" and first.group_id == second.group_id  # the stand-in is stable
    assert lrl.stats()["task_values_not_json"] - before == 2


def test_task_named_by_parameter(traced):
    @lrl.trace(task="question")
    def solve(client, question):
        return 1.0

    @lrl.trace(task=["question", "level"])
    def solve2(client, question, level=1):
        return 1.0

    solve(object(), "why?")
    solve2(object(), "how?")
    assert [r.task for r in traced.rollouts()] == ["why?", {"question": "how?", "level": 1}]
    with pytest.raises(lrl.ConfigurationError, match=r"names \['prompt'\].*\['client', 'question'\]"):
        lrl.trace(task="prompt")(lambda client, question: 1.0)


def test_task_override_function(traced):
    @lrl.trace(task=lambda client, question: {"q": question})
    def agent(client, question):
        return 1.0

    agent(object(), "why?")
    assert _only(traced).task == {"q": "why?"}


def test_rollout_overrides_set_ids_group_attempt_and_mode(traced):
    @lrl.trace
    def agent(x):
        return 0.0

    with lrl.rollout_overrides(rollout_id="r-1", group_id="g", attempt=2, mode="eval"):
        agent(1)
    r = traced.get_rollout("r-1")
    assert (r.group_id, r.attempt, r.mode) == ("g", 2, "eval")


def test_same_task_shares_group_id(traced):
    @lrl.trace
    def agent(x):
        return 0.0

    agent({"a": 1, "b": 2})
    agent({"b": 2, "a": 1})
    agent({"a": 2})
    groups = [r.group_id for r in traced.rollouts()]
    assert groups[0] == groups[1] != groups[2]


def test_policy_version_recorded_on_rollout_and_filterable(traced):
    @lrl.trace
    def agent(x):
        return 0.0

    agent(1)
    lrl.set_policy_version(3)
    agent(2)
    assert [r.policy_version for r in traced.rollouts()] == [0, 3]
    assert [t.task for t in lrl.trajectories(traced, min_policy_version=1)] == [2]


def test_private_provider_leaves_global_alone_and_parents_user_spans(traced):
    user_exporter = InMemorySpanExporter()
    user_provider = TracerProvider()
    user_provider.add_span_processor(SimpleSpanProcessor(user_exporter))
    user_tracer = user_provider.get_tracer("user")
    assert tracing.provider is not otel_trace.get_tracer_provider()

    @lrl.trace
    def agent(x):
        with user_tracer.start_as_current_span("user work"):
            pass
        return 1.0

    agent(1)
    (user_span,) = user_exporter.get_finished_spans()
    root = traced.spans(_only(traced).rollout_id)[0]
    assert format(user_span.parent.span_id, "016x") == root.span_id  # one context across providers
    assert all(s.name == "user work" for s in user_exporter.get_finished_spans())  # ours not given


def test_user_processor_can_receive_our_spans(traced):
    exporter = InMemorySpanExporter()
    lrl.configure(span_processors=[SimpleSpanProcessor(exporter)])

    @lrl.trace
    def agent(x):
        return 1.0

    agent(1)
    assert "invoke_agent agent" in [s.name for s in exporter.get_finished_spans()]


def test_tool_span_records_plain_code_tool_calls(traced):
    @lrl.trace
    def agent(x):
        with lrl.agent_scope("solver"), lrl.tool_span("calculator", call_id="call_1", arguments={"e": "1+2"}) as tool:
            tool.result = 3
        with lrl.tool_span("broken", call_id="call_2"):
            raise ValueError("tool failed")

    with pytest.raises(ValueError):
        agent(1)
    t = next(lrl.trajectories(traced))
    ok, broken = t.tool_spans
    assert ok.attributes["gen_ai.tool.call.id"] == "call_1" and ok.attributes["gen_ai.tool.call.result"] == "3"
    assert ok.attributes["gen_ai.tool.call.arguments"] == '{"e":"1+2"}' and ok.attributes["gen_ai.agent.name"] == "solver"
    assert broken.status_code == "ERROR"
    with lrl.tool_span("outside") as tool:  # outside a rollout: nothing recorded, nothing raised
        tool.result = 1


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_configuring_the_same_store_again_opens_nothing_new(traced, tmp_path):
    # A verl agent loop per sample, a runner per task: each calls configure(store=URL).
    url = f"sqlite:///{tmp_path / 'again.db'}"
    first = lrl.configure(store=url)
    threads, fds = threading.active_count(), _open_fds()
    for _ in range(200):
        assert lrl.configure(store=url) is first
        assert lrl.configure(store=str(tmp_path / "again.db")) is first  # a plain path names it too
    assert threading.active_count() == threads and _open_fds() == fds
    other = lrl.configure(store=f"sqlite:///{tmp_path / 'other.db'}")
    assert other is not first and other.url.endswith("other.db")
    assert lrl.configure(store="memory://") is not lrl.configure(store="memory://")  # always a new one
    first.close()
    other.close()


def test_a_call_another_thread_is_finishing_when_the_rollout_ends_is_in_its_trajectory(traced, monkeypatch):
    """A CI run of the Claude Code hang test read its timed-out rollout with 0 calls: the gateway's thread was
    finishing the call the CLI hung up on (it had left the rollout's open calls) while the rollout ended, so the
    end neither finished it nor waited for it, and the call's span was stored after the rollout. The end now
    waits for a call being finished elsewhere."""
    from lightning_rl.capture import CapturedCall, Server
    from lightning_rl.tracer import current_rollout

    entered, real = threading.Event(), CapturedCall._choice_attributes

    def slow(self, choice):  # the finishing thread, slowed inside finish (a loaded machine)
        if threading.current_thread().name == "finisher":
            entered.set()
            threading.Event().wait(0.5)
        return real(self, choice)

    monkeypatch.setattr(CapturedCall, "_choice_attributes", slow)
    finisher: list[threading.Thread] = []

    @lrl.trace
    def agent() -> float:
        call = CapturedCall(Server.from_url("http://127.0.0.1:9/v1"), {"model": "tiny", "messages": []}, "chat",
                            current_rollout())
        finisher.append(threading.Thread(target=call.finish, kwargs={"incomplete": True}, name="finisher"))
        finisher[0].start()
        assert entered.wait(10)
        return 1.0

    agent()
    (rollout,) = traced.rollouts()
    (call,) = lrl.trajectory(traced, rollout.rollout_id).llm_calls  # stored by the time the agent returned
    assert call.incomplete
    finisher[0].join()
