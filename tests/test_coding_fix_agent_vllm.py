"""The coding-fix agent (examples/coding_fix/agent.py, issue 56) against the real vLLM server, each try in a bwrap
sandbox from a pool per task, scored by the task's tests after the agent with the tests restored. The first turn is
forced to run the tests (``tool_choice``); what the model does after is its own, so the test asserts what was
recorded, whether the agent ends well or not."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.sandbox.pool import PoolPerTask
from lightning_rl.trainer_bridge.runner import Runner

from .conftest import SERVED_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "coding_fix"))
import agent as coding_agent  # noqa: E402
import tasks as family  # noqa: E402
import tools  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_coding_agent_runs_its_tools_in_its_sandbox_and_is_scored_by_the_tests(traced, vllm_url, tmp_path):
    made = {t.task_id: t for t in (family.generate(s, difficulty=0, kind=k) for s, k in ((1, "swapped"),
                                                                                          (2, "off_by_one")))}

    def folder_of(task):
        return task["id"], made[task["id"]].write(tmp_path / task["id"])

    client = openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY", max_retries=0)
    agent = coding_agent.make_agent(client, SERVED_NAME, 1.0, first_tool="run_tests")
    groups = [traced.enqueue({"id": t.task_id, "prompt": t.prompt}, n=2)[0].group_id for t in made.values()]
    pools = PoolPerTask(folder_of, size=2)
    try:
        with Runner(traced, agent, concurrency=4, sandboxes=pools, score=tools.score,
                    protect=list(family.Task.protected)) as runner:
            runner.run_until_done(groups)
    finally:
        pools.close()
    for entry in traced.queue_entries(groups):
        rollout = traced.get_rollout(entry.rollout_id)
        assert rollout.status == entry.outcome and rollout.status in ("succeeded", "failed"), rollout.error
        calls = lrl.trajectory(traced, entry.rollout_id).llm_calls
        assert calls and all(c.token_ids_source == "engine" and c.prompt_token_ids and c.response_token_ids
                             for c in calls)
        (asked,) = calls[0].tool_calls
        assert asked.name == "run_tests"  # forced
        (first_tool,) = [t for t in lrl.trajectory(traced, entry.rollout_id).tool_spans
                         if t.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) == asked.id]
        assert first_tool.name == "execute_tool run_tests"  # run in the try's sandbox: the task's real tests fail
        assert first_tool.attributes[semconv.TOOL_RESULT].startswith("FAILED: 3 of 3 tests\ntests/test_pkg.py:")
        if rollout.status == "succeeded":
            (reward,) = traced.rewards(entry.rollout_id)
            assert reward.value in (0.0, 1.0)
    # nothing of a try reached the task's own folder
    for task in made.values():
        for path, text in task.files.items():
            assert (tmp_path / task.task_id / path).read_text() == text
