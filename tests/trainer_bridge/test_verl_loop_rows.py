"""The verl agent loop's rows go through verl 0.9.1's own post-processing and batching (CPU, no
server): a batch mixing a good try, a placeholder, a try without engine log-probs, an over-long
prompt and failures concatenates, and only the good rows carry gradient."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

import lightning_rl as lrl
from lightning_rl.errors import ConfigurationError
from lightning_rl.records import Reward, RewardSource, RolloutStatus

from ..conftest import ensure_tiny_model
from ..store.helpers import llm_span, rollout

pytestmark = pytest.mark.verl
pytest.importorskip("verl")
loop_module = pytest.importorskip("lightning_rl.trainer_bridge.verl_agent_loop")

PROMPT_LENGTH, RESPONSE_LENGTH = 8, 6


def _loop(db):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    model = str(ensure_tiny_model())
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH},
                              "model": {"path": model}},
        "lightning_rl": {"agent": "tests.trainer_bridge.verl_agents:two_turn_solver", "store": f"sqlite:///{db}",
                         "server_url": "http://127.0.0.1:9/v1", "model": "tiny", "failure_reward": -0.5},
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


def _verl_worker(tokenizer):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # verl's own methods, without Ray
    worker.rollout_config = SimpleNamespace(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    worker.tokenizer, worker.processor, worker.hf_model_type = tokenizer, None, "qwen2"
    worker.reward_loop_worker_handles, worker.distillation_enabled, worker.mm_processor_kwargs = None, False, {}
    return worker


def test_a_mixed_batch_goes_through_verls_postprocess(tmp_path):
    db = tmp_path / "verl.db"
    loop = _loop(db)
    _store_tries(loop.store)
    names = ["good", "placeholder", "no_logprobs", "long", "model_failure", "infra_failure"]
    rows = [loop.output(lrl.trajectory(loop.store, rid)) for rid in names]
    masked = {rid: row.extra_fields["masked"] for rid, row in zip(names, rows)}
    assert masked == {"good": "", "placeholder": "no_sample", "no_logprobs": "no_engine_logprobs",
                      "long": "prompt_too_long", "model_failure": "", "infra_failure": "infra_failure"}
    assert [r.reward_score for r in rows] == [1.0, -0.5, 1.0, 1.0, -0.5, 0.0]
    assert [r.extra_fields["failure"] for r in rows] == ["", "model", "", "", "model", "infra"]
    assert rows[3].prompt_ids == list(range(13, 21))  # left-truncated to prompt_length
    assert all(r.extra_fields["policy_version"] is None for r in rows)  # no publish recorded: verl's own sync

    worker = _verl_worker(loop.tokenizer)

    async def post():
        return [await worker._agent_loop_postprocess(r, False, raw_prompt=[]) for r in rows]

    batch = worker._postprocess(asyncio.run(post()), input_non_tensor_batch={}, validate=False)
    t = batch.batch
    assert t["prompts"].shape == (6, PROMPT_LENGTH) and t["responses"].shape == (6, RESPONSE_LENGTH)
    assert t["rollout_log_probs"].shape == (6, RESPONSE_LENGTH)
    assert t["response_mask"].sum(dim=1).tolist() == [2, 0, 0, 0, 2, 0]  # gradient only where it is right
    assert t["rollout_log_probs"][0, :2].tolist() == pytest.approx([-0.1, -0.2])


class _Balancer:
    """The two methods of verl 0.9.1's LLMServerClient that the loop uses, counting what is held."""

    def __init__(self):
        self.held = 0

    async def _acquire_server(self, request_id):
        self.held += 1
        return "10.0.0.1:8000", object()

    def _release_server(self, server_id, request_id=None):
        assert server_id == "10.0.0.1:8000"
        self.held -= 1


def test_the_server_is_given_back_whatever_the_agent_does():
    balancer = _Balancer()

    async def use(fail):
        async with loop_module.verl_server(balancer, "r1") as address:
            assert address == "10.0.0.1:8000" and balancer.held == 1
            if fail:
                raise RuntimeError("agent crashed")

    asyncio.run(use(False))
    with pytest.raises(RuntimeError):
        asyncio.run(use(True))
    assert balancer.held == 0
    with pytest.raises(ConfigurationError, match="server_url"):
        asyncio.run(loop_module.verl_server(object(), "r2").__aenter__())
