"""The verl agent loop's rows (CPU, no server): a good try, a placeholder, a try without engine log-probs, an
long prompt and failures each give rows of the right shape, and only the good ones carry gradient
(``test_verl_v1_rows.py`` puts such a batch through verl's V1 trainer code). verl's legacy trainer, which takes
one row per try, is refused; the load balancer's server is always given back (verl 0.9.1 and 0.9.0)."""

from __future__ import annotations

import asyncio
import time

import pytest

import lightning_rl as lrl
from lightning_rl.errors import ConfigurationError
from lightning_rl.records import Reward, RewardSource, RolloutStatus

from ..conftest import ensure_tiny_model
from ..store.helpers import llm_span, rollout

pytestmark = pytest.mark.verl
pytest.importorskip("verl")
loop_module = pytest.importorskip("lightning_rl.trainer_bridge.verl.agent_loop")

PROMPT_LENGTH, RESPONSE_LENGTH = 8, 6


def _loop(db, *, v1=True, **lightning):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    model = str(ensure_tiny_model())
    config = OmegaConf.create({
        "trainer": {"use_v1": v1},
        "actor_rollout_ref": {"rollout": {"prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH},
                              "model": {"path": model}},
        "lightning_rl": {"agent": "tests.trainer_bridge.verl_agents:two_turn_solver", "store": f"sqlite:///{db}",
                         "server_url": "http://127.0.0.1:9/v1", "model": "tiny", "failure_reward": -0.5, **lightning},
    })
    return loop_module.LightningRLAgentLoop(DictConfigWrap(config), None, AutoTokenizer.from_pretrained(model), None,
                                            RLHFDataset, DictConfigWrap(OmegaConf.create({})), hf_model_type="qwen2")


def _store_tries(store):
    def add(rid, spans, status=RolloutStatus.SUCCEEDED, error=None, reward=1.0):
        store.start_rollout(rollout(rid, group_id="g"))
        store.add_spans(spans)
        if reward is not None:
            store.write_reward(Reward(rollout_id=rid, value=reward, source=RewardSource.RETURNED))
        store.finish_rollout(rid, status, time.time(), error)

    add("good", [llm_span("good", 0, 0, [1, 2, 3], [4, 5], logprobs=[-0.1, -0.2])])
    add("placeholder", [], status=RolloutStatus.FAILED, error="ValueError: no tool call", reward=None)
    no_logprobs = llm_span("no_logprobs", 0, 0, [1, 2, 3], [4, 5, 6])
    no_logprobs.tokens.response_logprobs = None
    add("no_logprobs", [no_logprobs])
    add("long", [llm_span("long", 0, 0, list(range(1, 21)), [4, 5])])  # 20 prompt tokens > 8
    add("model_failure", [llm_span("model_failure", 0, 0, [1, 2, 3], [7, 8])], status=RolloutStatus.FAILED,
        error="JSONDecodeError: Expecting value", reward=None)
    add("infra_failure", [llm_span("infra_failure", 0, 0, [1, 2, 3], [7, 8])], status=RolloutStatus.FAILED,
        error="APIConnectionError: Connection error.", reward=None)
    store.flush()


def test_every_kind_of_try_gives_rows_of_the_right_shape(tmp_path):
    db = tmp_path / "verl.db"
    loop = _loop(db)
    _store_tries(loop.store)
    names = ["good", "placeholder", "no_logprobs", "long", "model_failure", "infra_failure"]
    outputs = {rid: loop.output(lrl.trajectory(loop.store, rid)) for rid in names}
    assert {rid: len(rows) for rid, rows in outputs.items()} == dict.fromkeys(names, 1)
    rows = [outputs[rid][0] for rid in names]
    masked = {rid: row.extra_fields["masked"] for rid, row in zip(names, rows)}
    assert masked == {"good": "", "placeholder": "no_sample", "no_logprobs": "no_engine_logprobs",
                      "long": "", "model_failure": "", "infra_failure": "infra_failure"}
    assert [r.reward_score for r in rows] == [1.0, -0.5, 1.0, 1.0, -0.5, 0.0]
    assert [r.extra_fields["failure"] for r in rows] == ["", "model", "", "", "model", "infra"]
    assert rows[3].prompt_ids == list(range(1, 21))  # whole: V1 takes rows unpadded (not cut to prompt_length)
    assert all(r.extra_fields["policy_version"] is None for r in rows)  # no publish of "tiny" recorded
    assert [sum(r.response_mask) for r in rows] == [2, 0, 0, 2, 2, 0]  # gradient only where it is right
    assert [r.extra_fields["segment_reward"] for r in rows] == [r.reward_score for r in rows]
    assert all(len(r.response_logprobs) == len(r.response_ids) <= RESPONSE_LENGTH for r in rows)


def test_verls_legacy_trainer_is_refused_when_the_loop_is_made(tmp_path):
    with pytest.raises(ConfigurationError, match=r"trainer\.use_v1=false.*segments"):
        _loop(tmp_path / "verl.db", v1=False)


class _Balancer:
    """The two methods of verl's LLMServerClient that the loop uses, counting what is held: 0.9.1's release
    takes the request id, 0.9.0's does not."""

    def __init__(self):
        self.held = 0

    async def _acquire_server(self, request_id):
        self.held += 1
        return "10.0.0.1:8000", "handle"

    def _release_server(self, server_id, request_id=None):
        assert server_id == "10.0.0.1:8000" and request_id == "r1"
        self.held -= 1


class _Balancer090(_Balancer):
    def _release_server(self, server_id):  # verl 0.9.0's signature
        assert server_id == "10.0.0.1:8000"
        self.held -= 1


@pytest.mark.parametrize("balancer_class", [_Balancer, _Balancer090])
def test_the_server_is_given_back_whatever_the_agent_does(balancer_class):
    balancer = balancer_class()

    async def use(fail):
        async with loop_module.verl_server(balancer, "r1") as (address, handle):
            assert (address, handle) == ("10.0.0.1:8000", "handle") and balancer.held == 1
            if fail:
                raise RuntimeError("agent crashed")

    asyncio.run(use(False))
    with pytest.raises(RuntimeError):
        asyncio.run(use(True))
    assert balancer.held == 0
    with pytest.raises(ConfigurationError, match="server_url"):
        asyncio.run(loop_module.verl_server(object(), "r2").__aenter__())


def test_a_try_no_runner_finished_in_time_is_cancelled_in_the_queue(tmp_path):
    """``lightning_rl.rollouts=external``: a try no runner finished within ``external_timeout`` is a row without
    gradient and is cancelled in the store's queue, so a runner that comes later never runs it (it would call
    verl's server during a weight sync and record a stray ``train`` rollout)."""
    from lightning_rl.records import QueueStatus

    loop = _loop(tmp_path / "verl.db", rollouts="external", external_timeout=0.5)
    (output,) = asyncio.run(loop.run({"temperature": 1.0}, uid="u1", extra_info={"task": {"q": 1}}, global_steps=1))
    assert output.extra_fields["masked"] == "external_timeout" and output.extra_fields["failure"] == "infra"
    (entry,) = loop.store.queue_entries(["u1"])
    assert entry.status == QueueStatus.CANCELLED
    assert loop.store.lease("late-runner", lease_seconds=30) == []  # never run
