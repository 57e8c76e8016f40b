"""Claude Code (the real CLI, pinned in examples/cli_agents, ``make node-deps``) through the gateway against
the real vLLM server with a long window (``vllm_long_url``): every call it makes recorded with the engine's
token ids and log-probs, whatever model name it asks for sent as the served policy, its tool calls and
results, its sub-agents and compactions told apart, and its failures, hangs and refused requests ending
the rollout with the reason."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import BackgroundGateway, CommandFailed
from lightning_rl.gateway.coding_agents import CLAUDE_CODE_COMPACTION, CLAUDE_CODE_QUIET, CLAUDE_CODE_SUBAGENT
from lightning_rl.records import RolloutStatus

from ..conftest import SERVED_NAME
from .forcing_proxy import ForcingProxy
from .machine_pace import cli_time_limit

pytestmark = [pytest.mark.vllm]
CLAUDE = Path(__file__).resolve().parents[2] / "examples" / "cli_agents" / "node_modules" / ".bin" / "claude"
needs_claude = pytest.mark.skipif(not CLAUDE.is_file(), reason="the Claude Code CLI of examples/cli_agents "
                                  "(make node-deps installs @anthropic-ai/claude-code 2.1.332)")
GREEDY = {"temperature": 0.0, "seed": 0}  # imposed on every call of the rollout (Claude Code sends none)


def _calls_with_engine_ids(traj):
    assert traj.llm_calls
    for call in traj.llm_calls:
        assert call.token_ids_source == "engine" and call.streamed, call
        assert call.model == SERVED_NAME and len(call.prompt_token_ids) > 100
        assert len(call.response_logprobs) == len(call.response_token_ids) >= 1


def _asked(store, rollout_id):
    return [s.attributes.get(semconv.ASKED_MODEL) for s in store.spans(rollout_id) if s.kind == "CLIENT"]


@needs_claude
def test_claude_code_run_by_lrl_command_has_every_call_recorded(traced, vllm_long_url, tmp_path):
    """The issue's recipe (lrl.command running ``claude -p``): it ended with 0 calls recorded, because the
    CLI got no Anthropic URL and key (then the rollout's URL with /v1 twice), its mid-conversation system
    turns were refused, and the model it asks for (claude-opus-*) is not served. Now each call is recorded."""
    agent = lrl.command([str(CLAUDE), "-p", "--no-session-persistence"], upstream=vllm_long_url, model=SERVED_NAME,
                        name="claude", env={**CLAUDE_CODE_QUIET, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8",
                                            "CLAUDE_CONFIG_DIR": str(tmp_path / "cfg")})
    with lrl.rollout_overrides(sampling=GREEDY):
        asyncio.run(agent("Say hi"))  # the full default system prompt and tools
    (rollout,) = traced.rollouts()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    assert traj.status == RolloutStatus.SUCCEEDED
    _calls_with_engine_ids(traj)
    assert all(name and name.startswith("claude-") for name in _asked(traced, rollout.rollout_id))
    system = traj.llm_calls[0].input_messages[0]
    assert system["role"] == "system" and "Claude" in system["content"]


@needs_claude
def test_claude_code_runs_a_tool_and_its_call_and_result_are_recorded(traced, vllm_long_url, tmp_path):
    (tmp_path / "work").mkdir()
    note = tmp_path / "work" / "note.txt"
    note.write_text("the answer is 42\n")
    # the first answer may only be this call (guided decoding, tests/gateway/forcing_proxy.py): the CLI runs it, in
    # its sandbox, where its copy of the task's folder is /work
    with ForcingProxy(vllm_long_url, call=("Read", {"file_path": "/work/note.txt"})) as engine:
        agent = lrl.claude_code("Read {file} and tell me what it says.", upstream=engine.url, model=SERVED_NAME,
                                tools="Read", allowed_tools="Read", system_prompt="You are a careful assistant.",
                                max_turns=3, max_output_tokens=16, cwd=tmp_path / "work",
                                timeout=cli_time_limit(vllm_long_url, str(CLAUDE), calls=3),
                                reward=lambda task, out: float("42" in out))
        with lrl.rollout_overrides(sampling=GREEDY):
            reward = asyncio.run(agent({"file": str(note)}))
    assert len(engine.forced) == 1
    (rollout,) = traced.rollouts()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    assert traj.status == RolloutStatus.SUCCEEDED and traj.name == "claude-code"
    _calls_with_engine_ids(traj)
    first, second = traj.llm_calls[:2]
    (asked,) = first.tool_calls
    assert asked.name == "Read" and json.loads(asked.arguments) == {"file_path": "/work/note.txt"}
    # the CLI ran it; its result came back in the next request (the answers after it may call no tool)
    asked_ids = {c.id for call in traj.llm_calls for c in call.tool_calls}
    assert {t.attributes[semconv.GEN_AI_TOOL_CALL_ID] for t in traj.tool_spans} <= asked_ids
    (tool,) = [t for t in traj.tool_spans if t.attributes[semconv.GEN_AI_TOOL_CALL_ID] == asked.id]
    assert tool.attributes[semconv.GEN_AI_TOOL_NAME] == "Read"
    assert "the answer is 42" in tool.attributes[semconv.TOOL_RESULT]
    assert any(m.get("role") == "tool" and "the answer is 42" in m["content"] for m in second.input_messages)
    # the caller's reward, from what the CLI printed (the tiny model's answer: whatever it is)
    assert reward == traj.final_reward in (0.0, 1.0)


def test_sub_agent_and_compaction_requests_are_told_apart(traced, vllm_long_url):
    """Requests shaped as Claude Code 2.1.332 sends them (captured from the real CLI: the tiny model does not
    call the Agent tool or fill the window), through the gateway to the real engine."""
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=sdk-cli;"},
              {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}]
    base = {"model": "claude-opus-5-5", "max_tokens": 4, "temperature": 0, "stream": True, "system": system,
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "medium"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": json.dumps({"session_id": "s-1"})}}
    hello = {"role": "user", "content": [{"type": "text", "text": "Count the files",
                                          "cache_control": {"type": "ephemeral"}}]}
    env = {"role": "system", "content": [{"type": "text", "text": "# Environment\nPlatform: linux"}]}
    compact = {"role": "user", "content": "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\nYour task is to "
               "create a detailed summary of the conversation so far, paying close attention to ..."}
    resumed = {"role": "user", "content": "This session is being continued from a previous conversation that ran out "
               "of context. The summary below covers the earlier portion of the conversation."}
    with BackgroundGateway([vllm_long_url]) as gw:
        opened = httpx.post(f"{gw.url}/v1/rollouts", json={"task": "lineage", "model": SERVED_NAME}).json()
        url, key = opened["base_url"] + "/messages?beta=true", {"x-api-key": opened["api_key"]}
        sent = [({}, [hello, env]), ({"x-claude-code-agent-id": "a5c5bc68796af2937"}, [hello, env]),
                ({}, [hello, {"role": "assistant", "content": "ok"}, compact]), ({}, [resumed, env])]
        for headers, messages in sent:
            r = httpx.post(url, json={**base, "messages": messages}, headers={**key, **headers}, timeout=120)
            assert r.status_code == 200 and "message_stop" in r.text
        refused = httpx.post(url, headers=key, timeout=30, json={**base, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]})
        doubled = httpx.post(opened["base_url"] + "/v1/messages", json={**base, "messages": [hello]}, headers=key)
        httpx.post(f"{gw.url}/v1/rollouts/{opened['rollout_id']}/finish", json={}, headers=key)
    # a request the dialect cannot carry: a 400 in Anthropic's shape naming the block, kept on the rollout
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and "'image'" in error["message"]
    assert doubled.status_code == 404 and "without its /v1" in doubled.json()["error"]["message"]
    traced.flush()
    traj = lrl.trajectory(traced, opened["rollout_id"])
    assert [c.agent_name for c in traj.llm_calls] == ["gateway", CLAUDE_CODE_SUBAGENT, CLAUDE_CODE_COMPACTION,
                                                      "gateway"]
    assert all(c.token_ids_source == "engine" for c in traj.llm_calls)
    calls = sorted((s for s in traced.spans(opened["rollout_id"]) if s.kind == "CLIENT"),
                   key=lambda s: s.attributes[semconv.LLM_CALL_INDEX])
    assert [s.attributes.get(semconv.CALL_LINEAGE) for s in calls] == [None, "subagent", "compaction", "compacted"]
    assert calls[1].attributes[semconv.GEN_AI_AGENT_ID] == "a5c5bc68796af2937"
    assert [c.input_messages[-1]["role"] for c in traj.llm_calls[:2]] == ["system", "system"]  # carried, not dropped
    (root,) = [s for s in traced.spans(opened["rollout_id"]) if s.parent_id is None]
    (event,) = [e for e in root.events if e["name"] == "request refused"]
    assert "'image'" in event["attributes"]["error"]
    stats = lrl.stats()
    assert all(stats.get(f"claude_code_{x}_calls", 0) >= 1 for x in ("subagent", "compaction", "compacted"))


def _group_alive(pgid: int) -> list[str]:
    """The processes of a group still running (an exited one left unreaped, a zombie, runs nothing: the sandbox's
    init, whose parent bwrap was killed, waits for the host's init to reap it)."""
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[0] == str(pgid) and not line.split()[2].startswith("Z")]


def _groups_left(pgids: set[int], within: float = 5.0) -> list[list[str]]:
    """The processes of ``pgids`` still running once ``within`` seconds have passed (or none are): a process SIGKILLed
    a moment ago can still be exiting (state R, its arguments gone: ``[bwrap]``, seen once in a fresh-clone run); one
    the kill missed is still there after."""
    deadline = time.monotonic() + within
    while True:
        left = [alive for alive in map(_group_alive, pgids) if alive]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@needs_claude
def test_claude_code_in_its_sandbox_reads_no_file_of_the_host_and_reaches_only_the_gateway(traced, vllm_long_url,
                                                                                          tmp_path):
    """The CLI runs in a bwrap sandbox by default: a Read of a host file (a secret beside the task) finds nothing,
    and its calls still reach the engine through the gateway bridged into the sandbox (its only network)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret 1234\n")
    (tmp_path / "work").mkdir()
    with ForcingProxy(vllm_long_url, call=("Read", {"file_path": str(secret)})) as engine:
        agent = lrl.claude_code("Read the file.", upstream=engine.url, model=SERVED_NAME, tools="Read",
                                allowed_tools="Read", system_prompt="Be terse.", max_turns=2, max_output_tokens=8,
                                cwd=tmp_path / "work", timeout=cli_time_limit(vllm_long_url, str(CLAUDE), calls=2))
        with lrl.rollout_overrides(sampling=GREEDY):
            try:
                asyncio.run(agent("go"))
            except CommandFailed:  # the run may end either way: what was recorded is what matters
                pass
    (rollout,) = traced.rollouts()
    traj = lrl.trajectory(traced, rollout.rollout_id)
    assert len(traj.llm_calls) >= 2  # the forced call, then the one carrying the tool's result
    (tool,) = [t for t in traj.tool_spans if t.attributes[semconv.GEN_AI_TOOL_NAME] == "Read"]
    assert "1234" not in tool.attributes[semconv.TOOL_RESULT] and "does not exist" in tool.attributes[semconv.TOOL_RESULT]
    assert "host secret" not in json.dumps([c.input_messages for c in traj.llm_calls])


@needs_claude
def test_a_failing_or_hanging_claude_code_ends_its_rollout_with_the_reason(traced, vllm_long_url, tmp_path):
    bad = lrl.claude_code(upstream=vllm_long_url, model=SERVED_NAME, extra_args=["--no-such-flag"], timeout=60)
    with pytest.raises(CommandFailed, match="exited with status 1: .*no-such-flag"):
        asyncio.run(bad("Say hi"))
    # an engine that never answers: the CLI waits on its call until the timeout kills its process group
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    seen: list[int] = []
    hung = lrl.claude_code(upstream=f"http://127.0.0.1:{silent.getsockname()[1]}", model=SERVED_NAME,
                           system_prompt="Be terse.", tools="", timeout=8)

    async def run() -> None:
        task = asyncio.ensure_future(hung("Say hi"))
        while not seen and not task.done():  # the CLI's process group, while it runs
            await asyncio.sleep(0.2)
            out = subprocess.run(["ps", "-eo", "pgid=,args="], capture_output=True, text=True).stdout
            seen.extend(int(line.split()[0]) for line in out.splitlines() if f"{CLAUDE} -p" in line)
        await task

    try:
        with pytest.raises(TimeoutError, match="ran past its timeout of 8 s; its process group was killed"):
            asyncio.run(run())
    finally:
        silent.close()
    assert seen
    assert _groups_left(set(seen)) == []
    failed, timed_out = sorted(traced.rollouts(), key=lambda r: r.status)
    assert failed.status == RolloutStatus.FAILED and "no-such-flag" in failed.error
    assert timed_out.status == RolloutStatus.TIMED_OUT and "its process group was killed" in timed_out.error
    (cut,) = lrl.trajectory(traced, timed_out.rollout_id).llm_calls  # the call it waited on, kept (unfinished)
    assert cut.incomplete and cut.model == SERVED_NAME
    assert os.environ.get("ANTHROPIC_BASE_URL") is None  # the caller's environment untouched
