"""Codex (``codex exec``, the Responses API) and opencode (``opencode run``, chat completions), the real
CLIs pinned in examples/cli_agents (make node-deps), through the gateway against the real vLLM server
(the tiny model with a long window: their system prompts and tools are 10,000-18,000 tokens). Where a
test needs the model to call a tool, vLLM's guided decoding makes it call that tool with those arguments, and
no tool after it (``forcing_proxy.py``). Each run's time limit is derived from what the machine takes at the
time (``machine_pace.py``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import BackgroundGateway
from lightning_rl.gateway.coding_agents import codex, opencode
from lightning_rl.records import RolloutStatus

from ..conftest import SERVED_NAME, no_free_whitespace
from .forcing_proxy import ForcingProxy
from .machine_pace import cli_time_limit

pytestmark = [pytest.mark.vllm]
BIN = Path(__file__).resolve().parents[2] / "examples" / "cli_agents" / "node_modules" / ".bin"
GREEDY = {"temperature": 0.0, "seed": 0}


def _cli(program: str) -> str:
    path = BIN / program
    if not path.exists():
        pytest.skip(f"{path} is absent: make node-deps installs the pinned CLIs (examples/cli_agents)")
    return str(path)


def _every_call_recorded_with_the_engines_ids(traj) -> None:
    assert traj.llm_calls
    for call in traj.llm_calls:
        assert call.streamed and call.token_ids_source == "engine" and call.model == SERVED_NAME
        assert call.response_token_ids and len(call.response_logprobs) == len(call.response_token_ids)
        assert len(call.prompt_token_ids) > 1000  # the CLI's own system prompt (and tools), whole
    answered = {span.attributes[semconv.GEN_AI_TOOL_CALL_ID] for span in traj.tool_spans}
    for call in traj.llm_calls[:-1]:  # a tool call the CLI answered is a tool span (the last call's ended the run)
        assert {tc.id for tc in call.tool_calls} <= answered


# What Codex 0.171.0 sends (captured from the real CLI): its sub-agent tools as a namespace, reasoning,
# include, store, prompt_cache_key, client_metadata, items with ids, a call with its namespace.
CODEX_BODY = {
    "model": SERVED_NAME, "stream": False, "tool_choice": {"type": "function", "name": "spawn_agent"},
    "parallel_tool_calls": False, "reasoning": {"summary": "auto"}, "store": False,
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a21c42", "client_metadata": {"x": "y"},
    "max_output_tokens": 120, "temperature": 0,
    "tools": [{"type": "function", "name": "exec_command", "strict": False, "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
            {"type": "function", "name": "spawn_agent", "strict": True, "parameters": {  # guided: a call
                "type": "object", "properties": {"message": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
                "required": ["message"], "additionalProperties": False}}]}],
    "input": [
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "What is 12+30?"}]},
        {"type": "function_call", "call_id": "call_a", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{\"message\": \"add\"}"},
        {"type": "function_call_output", "call_id": "call_a", "output": [{"type": "input_text", "text": "42"}]}]}


def test_codex_requests_are_carried_and_what_cannot_be_is_refused(traced, vllm_long_url):
    # the named tool choice is guided by vLLM; the proxy keeps it and takes away free whitespace, so the
    # call closes whatever the model's weights (the seed-7 model padded it with spaces past max_output_tokens)
    with ForcingProxy(vllm_long_url, choice=None, logit_bias=no_free_whitespace()) as engine, \
            BackgroundGateway([engine.url + "/v1"]) as gw:
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "codex shape"}).json()
        auth = {"authorization": f"Bearer {opened['api_key']}"}
        unreadable = {"x-codex-turn-metadata": "{not json"}  # the call is recorded, its line unknown (counted)
        answer = httpx.post(opened["base_url"] + "/responses", json=CODEX_BODY, headers={**auth, **unreadable},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        (call,) = [i for i in answer.json()["output"] if i["type"] == "function_call"]
        # a call to a namespace's function is answered with its namespace, as OpenAI's API does
        assert call["name"] == "spawn_agent" and call["namespace"] == "multi_agent_v1"
        assert answer.json()["parallel_tool_calls"] is False
        for extra, says in (({"tools": [{"type": "web_search", "external_web_access": True}]}, "'web_search' tool"),
                            ({"background": True}, "background"),
                            ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "'custom' tool")):
            refused = httpx.post(opened["base_url"] + "/responses", json={**CODEX_BODY, **extra}, headers=auth)
            assert refused.status_code == 400 and says in refused.json()["error"]["message"]
        # Codex's compaction request: no tools, tool_choice "auto" (vLLM refuses a tool_choice without tools)
        compaction = {**CODEX_BODY, "tools": [], "tool_choice": "auto", "max_output_tokens": 4}
        # a sub-agent named by its path below /root (Codex's agent paths), compacting its context
        meta = {"x-codex-turn-metadata": json.dumps({"agent_name": "/root/worker", "thread_id": "t-2",
                                                     "request_kind": "compaction", "window_number": 0})}
        compacted = httpx.post(opened["base_url"] + "/responses", json=compaction, headers={**auth, **meta}, timeout=60)
        assert compacted.status_code == 200
        forced = {**CODEX_BODY, "tools": [], "tool_choice": "required"}  # forced to call a tool it was not given
        refused = httpx.post(opened["base_url"] + "/responses", json=forced, headers=auth)
        assert refused.status_code == 400 and "no tools" in refused.json()["error"]["message"]
        httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={}, headers=auth)
    traced.flush()
    traj = lrl.trajectory(traced, opened["rollout_id"])
    recorded, compacting = traj.llm_calls  # the refused ones never reached the engine
    assert recorded.agent_name == "gateway" and lrl.stats().get("codex_turn_metadata_unreadable") == 1
    assert compacting.agent_name == "codex/worker"
    (span,) = [s for s in traced.spans(opened["rollout_id"]) if s.kind == "CLIENT" and
               s.attributes[semconv.LLM_CALL_INDEX] == 1]
    assert span.attributes[semconv.CALL_LINEAGE] == "compaction" and span.attributes[semconv.GEN_AI_AGENT_ID] == "t-2"
    assert recorded.token_ids_source == "engine" and [tc.name for tc in recorded.tool_calls] == ["spawn_agent"]
    (tool,) = traj.tool_spans  # the function_call_output answering call_a
    assert tool.name.endswith("spawn_agent") and tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_a"
    assert tool.attributes[semconv.TOOL_RESULT] == "42"


def _tool_call_ran_and_its_result_went_back(traj, engine) -> str:
    """The forced call is the only tool call: the tool and arguments forced, one of the tools offered; the CLI
    ran it (a tool span with the model's call id and what the tool answered, an error included) and sent that
    result in the next request of the same agent. Returns the result."""
    assert len(engine.forced) == 1
    offered = {tool["function"]["name"] for tool in engine.forced[0]["tools"]}
    (first,) = [call for call in traj.llm_calls if call.tool_calls]  # after it, no tool could be called
    (asked,) = first.tool_calls
    assert asked.name == engine.call[0] and json.loads(asked.arguments) == engine.call[1]
    assert asked.name in offered and asked.id
    (tool,) = [t for t in traj.tool_spans if t.attributes[semconv.GEN_AI_TOOL_CALL_ID] == asked.id]
    assert tool.attributes[semconv.GEN_AI_TOOL_NAME] == asked.name
    result = tool.attributes[semconv.TOOL_RESULT]
    assert result
    after = traj.llm_calls[traj.llm_calls.index(first) + 1:]
    assert any(m.get("role") == "tool" and m.get("tool_call_id") == asked.id and m.get("content") == result
               for call in after for m in call.input_messages)
    return result


def _note(tmp_path: Path) -> Path:
    """A folder for the CLI to work in, with a file for its forced tool call to read."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("the answer is 42\n")
    return work


def _calls(store, rollout_id):
    return sorted((s for s in store.spans(rollout_id) if s.kind == "CLIENT"),
                  key=lambda s: s.attributes[semconv.LLM_CALL_INDEX])


def test_codex_exec_calls_a_tool_and_its_call_and_result_are_recorded(traced, vllm_long_url, tmp_path):
    work, binary = _note(tmp_path), _cli("codex")
    # in its bwrap sandbox (the default): the task's folder is its copy at /work, where the command runs
    with ForcingProxy(vllm_long_url, call=("exec_command", {"cmd": "cat note.txt; cat /root/.bashrc"})) as engine:
        agent = codex(upstream=engine.url + "/v1", model=SERVED_NAME, binary=binary,
                      timeout=cli_time_limit(vllm_long_url, binary, calls=3),
                      reward=lambda task, answer: 0.5 if answer.strip() else 0.0)
        with lrl.rollout_overrides(sampling=GREEDY):
            reward = asyncio.run(agent({"prompt": "What does note.txt say?", "cwd": str(work)}))
    (rollout,) = traced.rollouts()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    # the caller's reward (from Codex's last message, whatever the tiny model answered), not a number it printed
    assert traj.status == RolloutStatus.SUCCEEDED and traj.name == "codex" and reward == traj.final_reward in (0, 0.5)
    _every_call_recorded_with_the_engines_ids(traj)
    result = _tool_call_ran_and_its_result_went_back(traj, engine)
    assert "the answer is 42" in result and "No such file" in result  # the task's copy, and no home of the host
    # Codex's turn metadata (x-codex-turn-metadata): the root agent's calls, on one thread, no other line
    calls = _calls(traced, rollout.rollout_id)
    assert len(calls) >= 2 and {c.attributes[semconv.GEN_AI_AGENT_NAME] for c in calls} == {"codex"}
    assert len({c.attributes[semconv.GEN_AI_AGENT_ID] for c in calls}) == 1
    assert not any(semconv.CALL_LINEAGE in c.attributes for c in calls)


def test_codex_sub_agent_and_compaction_calls_are_told_apart(traced, vllm_long_url):
    """The real CLI's own lines: its first answer is a spawn_agent call (guided decoding), so Codex starts a
    sub-agent thread; a window of 1,000 tokens makes it compact its context before each later turn."""
    binary = _cli("codex")
    with ForcingProxy(vllm_long_url, call=("spawn_agent", {"message": "Say hi."})) as engine:
        agent = codex(upstream=engine.url + "/v1", model=SERVED_NAME, binary=binary, sandbox="read-only",
                      timeout=cli_time_limit(vllm_long_url, binary, calls=6),
                      args=["-c", "model_auto_compact_token_limit=1000"])
        with lrl.rollout_overrides(sampling=GREEDY):
            asyncio.run(agent("What is 12+30?"))
    (rollout,) = traced.rollouts()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    assert traj.status == RolloutStatus.SUCCEEDED
    _every_call_recorded_with_the_engines_ids(traj)
    (spawn,) = [t for t in traj.tool_spans if t.attributes[semconv.GEN_AI_TOOL_NAME] == "spawn_agent"]
    child = json.loads(spawn.attributes[semconv.TOOL_RESULT])["agent_id"]  # what Codex answered the model
    lines = {(c.attributes[semconv.GEN_AI_AGENT_NAME], c.attributes.get(semconv.CALL_LINEAGE),
              c.attributes[semconv.GEN_AI_AGENT_ID] == child) for c in _calls(traced, rollout.rollout_id)}
    # the root's turns (before and after its compactions), its compactions, and the sub-agent's thread
    assert lines >= {("codex", None, False), ("codex", "compaction", False), ("codex", "compacted", False),
                     ("codex/thread_spawn", "subagent", True)}
    assert all((agent == "codex/thread_spawn") == on_child for agent, _, on_child in lines)
    stats = lrl.stats()
    assert all(stats.get(f"codex_{line}_calls", 0) >= 1 for line in ("subagent", "compaction", "compacted"))


def test_opencode_run_calls_a_tool_and_its_title_call_is_its_own_agent(traced, vllm_long_url, tmp_path):
    work, binary = _note(tmp_path), _cli("opencode")
    # in its bwrap sandbox (the default): the task's folder is its copy at /work
    with ForcingProxy(vllm_long_url, call=("read", {"filePath": "/work/note.txt"})) as engine:
        agent = opencode(upstream=engine.url + "/v1", model=SERVED_NAME, binary=binary,
                         timeout=cli_time_limit(vllm_long_url, binary, calls=4),
                         config={"permission": {"bash": "deny", "edit": "deny", "webfetch": "deny"}})
        with lrl.rollout_overrides(sampling=GREEDY):
            assert asyncio.run(agent({"prompt": "What does note.txt say?", "cwd": str(work)})) is None  # no reward
    (rollout,) = traced.rollouts()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    assert traj.status == RolloutStatus.SUCCEEDED
    _every_call_recorded_with_the_engines_ids(traj)
    assert "the answer is 42" in _tool_call_ran_and_its_result_went_back(traj, engine)  # opencode read the file
    agents = [call.agent_name for call in traj.llm_calls]
    assert "opencode-small" in agents and "opencode" in agents  # the title call and the main agent's
    assert {c.agent_name for c in traj.llm_calls if c.tool_calls} == {"opencode"}


def test_a_cli_that_fails_or_hangs_ends_its_rollout_with_what_it_recorded(traced, vllm_long_url):
    bad = codex(upstream=vllm_long_url, model=SERVED_NAME, binary=_cli("codex"), args=["-c", "model_provider=3"])
    with pytest.raises(lrl.LightningRLError, match="exited with status"):
        asyncio.run(bad("hi"))
    with pytest.raises(lrl.LightningRLError, match="the task must be the prompt"):
        asyncio.run(bad({"no": "prompt"}))
    # opencode's title call is answered; its main call (the one with tools) never is: the CLI waits on it
    # the limit must leave time for opencode to start and its title call (a 2,200-token prompt) to be answered,
    # whatever the load (10 s did not, with the machine's load average at 16)
    binary = _cli("opencode")
    limit = cli_time_limit(vllm_long_url, binary, calls=1, prompt_tokens=2_500)
    with ForcingProxy(vllm_long_url, stall=True) as engine:
        slow = opencode(upstream=engine.url + "/v1", model=SERVED_NAME, binary=binary, timeout=limit)
        with lrl.rollout_overrides(sampling=GREEDY), pytest.raises(TimeoutError, match="ran past its timeout"):
            asyncio.run(slow("What is 12+30?"))
    rollouts = traced.rollouts()
    assert len(rollouts) == 3 and RolloutStatus.SUCCEEDED not in {r.status for r in rollouts}
    (hung,) = [r for r in rollouts if r.name == "opencode"]
    assert hung.status == RolloutStatus.TIMED_OUT
    kept = lrl.trajectory(traced, hung.rollout_id).llm_calls
    assert any(c.agent_name == "opencode-small" and c.token_ids_source == "engine" for c in kept)  # kept
