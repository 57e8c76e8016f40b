"""``lightning-rl rollouts show``: a tool span's line says what the tool was given, by which agent, and what
it answered or the error it raised (a user trial found only ``status=UNSET`` there)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl.cli import main


def test_a_tool_line_shows_arguments_agent_result_and_error(traced, tmp_path):
    @lrl.trace(agent="solver")
    def solve(question):
        with lrl.tool_span("add", call_id="c1", arguments={"a": 2, "b": 3}) as span:
            span.result = {"sum": 5}
        with pytest.raises(ValueError), lrl.tool_span("divide", call_id="c2", arguments='{"a": 1, "b": 0}'):
            raise ValueError("division by zero")
        return 1.0

    solve("q")
    lrl.flush()
    (rollout,) = traced.rollouts()
    out = CliRunner().invoke(main, ["rollouts", "show", rollout.rollout_id, "--store", str(traced.path)]).output
    assert 'tool add({"a":2,"b":3}) by solver id=c1 -> {"sum":5}' in out, out
    assert 'tool divide({"a": 1, "b": 0}) by solver id=c2  ERROR ValueError: division by zero' in out, out
