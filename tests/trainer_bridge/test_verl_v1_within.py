"""``verl_v1.within``: the time limit of the verl tests' waits, and how it tells TransferQueue's unanswered
controller request (retried once by ``test_verl_agent_loop._run_v1_prompt``) from any other wait (a failure)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from .verl_v1 import TransferQueueNoReply, within


def _stuck_in(tmp_path, folder: str):
    """A coroutine function waiting for ever inside ``_request_controller`` of ``{folder}/client.py``."""
    (tmp_path / folder).mkdir()
    path = tmp_path / folder / "client.py"
    path.write_text("import asyncio\n\n\nasync def _request_controller():\n    await asyncio.Event().wait()\n")
    spec = importlib.util.spec_from_file_location(f"{folder}_client", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    async def put():
        await module._request_controller()

    return put


def test_a_result_comes_back_from_the_one_loop():
    async def answer(value):
        await asyncio.sleep(0.01)
        return value

    assert within(5, asyncio.run, answer(7)) == 7
    assert within(5, asyncio.run, answer(8)) == 8  # the same loop, again


def test_transferqueues_unanswered_request_is_named_and_any_other_wait_fails(tmp_path):
    with pytest.raises(TransferQueueNoReply, match=r"(?s)controller request was never answered.*_request_controller"):
        within(0.5, asyncio.run, _stuck_in(tmp_path, "transfer_queue")())
    with pytest.raises(pytest.fail.Exception, match=r"(?s)did not finish within 0.5 s.*in _request_controller"):
        within(0.5, asyncio.run, _stuck_in(tmp_path, "elsewhere")())
    assert within(5, asyncio.run, asyncio.sleep(0, result="free")) == "free"  # the cancelled waits left the loop
