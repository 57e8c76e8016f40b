"""Reward helpers (lightning_rl.rewards): values, bad input named, and what a traced agent stores."""

from __future__ import annotations

import asyncio
import math

import pytest

import lightning_rl as lrl
from lightning_rl import rewards
from lightning_rl.errors import ConfigurationError, InvalidRewardError, UnknownNameError
from lightning_rl.rewards import Score


def test_helper_values():
    assert rewards.exact_match("  The  Answer ", "the answer") == 1.0
    assert rewards.exact_match("the answer", "The answer", normalize=False) == 0.0
    assert rewards.numeric_match("so it is 41.9999999", 42) == 1.0
    assert rewards.numeric_match("first 42 then 43", 42) == 0.0  # the last number is the answer
    assert rewards.numeric_match("no idea", 42) == 0.0 and rewards.numeric_match(float("nan"), 42) == 0.0
    assert rewards.numeric_match("105", 100, rel_tol=0.1) == 1.0 and rewards.numeric_match("1e3", 1000) == 1.0
    assert rewards.regex_format("<answer>4</answer>", r"<answer>\d+</answer>", full=True) == 1.0
    assert rewards.regex_format("4", r"<answer>") == 0.0
    schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    assert rewards.json_schema('{"expression": "2+2"}', schema) == 1.0
    assert rewards.json_schema('{"expr": "2+2"}', schema) == 0.0 and rewards.json_schema("not json", schema) == 0.0
    calls = [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}]
    assert rewards.tool_use(calls, "calculator", schema=schema) == 1.0
    assert rewards.tool_use(calls, "calculator", schema={**schema, "required": ["x"]}) == 0.0
    assert rewards.tool_use([{"function": {"name": "calculator", "arguments": "{broken"}}], "calculator") == 0.0
    assert rewards.tool_use(None, "calculator") == 0.0
    assert rewards.length_penalty("x" * 10, 20) == 0.0
    assert rewards.length_penalty(list(range(30)), 20) == -0.5
    assert rewards.length_penalty(100, 20, scale=0.2) == -0.2
    total = rewards.weighted(rewards.numeric_match("4", 4), rewards.length_penalty(30, 20),
                             weights={"length_penalty": 0.5})
    assert total == 0.75 and total.name == "reward"
    assert total.reward_parts == {"numeric_match": 1.0, "length_penalty": -0.5}
    assert rewards.reward_helper("numeric_match") is rewards.numeric_match


def test_bad_input_is_named_never_a_silent_zero():
    with pytest.raises(InvalidRewardError, match="expected value"):
        rewards.numeric_match("4", float("inf"))
    with pytest.raises(InvalidRewardError, match="expected value"):
        rewards.numeric_match("4", "four")
    with pytest.raises(ConfigurationError, match="abs_tol must be >= 0"):
        rewards.numeric_match("4", 4, abs_tol=-1)
    with pytest.raises(ConfigurationError, match="does not compile"):
        rewards.regex_format("x", "(")
    with pytest.raises(ConfigurationError, match="not a valid JSON schema"):
        rewards.json_schema("{}", {"type": "no-such-type"})
    with pytest.raises(ConfigurationError, match="target must be an int >= 1"):
        rewards.length_penalty("x", 0)
    with pytest.raises(ConfigurationError, match="weights for scores not given: typo"):
        rewards.weighted(rewards.exact_match("a", "a"), weights={"typo": 2})
    with pytest.raises(ConfigurationError, match="two scores are named"):
        rewards.weighted(rewards.exact_match("a", "a"), rewards.exact_match("b", "b"))
    with pytest.raises(InvalidRewardError):
        Score(math.nan, "mine")
    with pytest.raises(UnknownNameError, match="known: exact_match"):
        rewards.reward_helper("nope")


def test_a_returned_score_stores_the_total_and_each_part_by_name_and_emit_works_mid_run(traced):
    @lrl.trace(name="scored")
    async def agent(task: dict) -> Score:
        rewards.tool_use([{"function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}],
                         "calculator").emit("step")
        return rewards.weighted(rewards.numeric_match(task["said"], 4), rewards.length_penalty(task["said"], 2),
                                weights={"length_penalty": 0.5})

    asyncio.run(agent({"said": "it is 4"}))
    traced.flush()
    (rollout,) = traced.rollouts()
    stored = {(r.name, r.source.value): r.value for r in traced.rewards(rollout.rollout_id)}
    assert stored == {("reward", "returned"): 0.5, ("numeric_match", "returned"): 1.0,
                      ("length_penalty", "returned"): -1.0, ("step", "emitted"): 1.0, ("tool_use", "emitted"): 1.0}
    assert lrl.trajectory(traced, rollout.rollout_id).final_reward == 0.5  # training reads the total
