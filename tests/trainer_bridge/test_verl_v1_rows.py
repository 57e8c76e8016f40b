"""Our rows through verl 0.9.1's V1 trainer code (CPU, a local Ray and a real TransferQueue, no GPU):
``AgentLoopWorkerTQ._agent_loop_postprocess`` puts them in the TransferQueue, V1's ``ReplayBuffer`` samples
them, and the trainer step's own ``_compute_advantage`` and ``_compute_metrics`` read them, including the
weight versions V1 reads from every row's tags (``min_global_steps``/``max_global_steps``). Before the rows
carried them, ``_compute_metrics`` raised ``TypeError: int() argument must be ... not 'NoneType'``."""

from __future__ import annotations

import asyncio
import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import Reward, RewardSource, RolloutStatus

from ..store.helpers import llm_span, rollout
from .verl_v1 import compose_config, train_step, transfer_queue, v1_worker, within  # noqa: F401 - a fixture

pytestmark = [pytest.mark.verl, pytest.mark.ray]
pytest.importorskip("verl")
pytest.importorskip("transfer_queue")
loop_module = pytest.importorskip("lightning_rl.trainer_bridge.verl_agent_loop")

AGENT = "tests.trainer_bridge.verl_agents:two_turn_solver"


def _config(db, n=2):
    return compose_config(db, prompt_length=16, response_length=12, n=n, agent=AGENT,
                          server_url="http://127.0.0.1:9/v1")


def _loop(config):
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    path = config.actor_rollout_ref.model.path
    return loop_module.LightningRLAgentLoop(DictConfigWrap(config), None, AutoTokenizer.from_pretrained(path), None,
                                            RLHFDataset, DictConfigWrap(config.data), hf_model_type="qwen2")


def _tries(store):
    """Two GRPO groups of 2 tries. ``split-*``: a rollout whose token prefix broke at its second call (its
    prompt does not extend the first call's prompt + response); stamped version 3."""
    def add(rid, group, spans, reward):
        store.start_rollout(rollout(rid, group_id=group))
        store.add_spans(spans)
        store.write_reward(Reward(rollout_id=rid, value=reward, source=RewardSource.RETURNED))
        store.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)

    for i in range(2):
        add(f"split-{i}", "g-split", [llm_span(f"split-{i}", 0, 0, [1, 2, 3], [4, 5], policy_version=3),
                                      llm_span(f"split-{i}", 1, 1, [9, 8, 7, 6], [5, 4, 3], policy_version=3)],
            reward=float(i))
        add(f"one-{i}", "g-one", [llm_span(f"one-{i}", 0, 0, [1, 2], [3, 4, 5], policy_version=3)], reward=0.5 * i)
    store.flush()


def _put(tq, worker, groups: dict[str, list], global_steps: int) -> None:
    """What V1's dispatch (``_add_batch_to_generate``) and its worker's ``_run_prompt`` do around a loop's
    outputs: the prompt's status tags, and ``_agent_loop_postprocess`` for each session."""
    async def put_all():
        await tq.async_kv_batch_put(keys=list(groups), partition_id="train", tags=[
            {"is_prompt": True, "status": "running", "global_steps": global_steps}] * len(groups))
        for uid, sessions in groups.items():
            for session, outputs in enumerate(sessions):
                await worker._agent_loop_postprocess(outputs, False, uid=uid, session_id=session,
                                                     global_steps=global_steps, index=0, raw_prompt=[],
                                                     agent_name="lightning_rl")
            await tq.async_kv_put(key=uid, partition_id="train", tag={"status": "finished"})

    within(120, asyncio.run, put_all())


def test_every_segment_is_a_row_that_v1s_step_trains_and_reads_versions_from(tmp_path, transfer_queue):
    tq = transfer_queue
    config = _config(tmp_path / "verl.db")
    loop = _loop(config)
    _tries(loop.store)
    rows = {rid: loop.output(lrl.trajectory(loop.store, rid)) for rid in ("split-0", "split-1", "one-0", "one-1")}
    assert [len(r) for r in rows.values()] == [2, 2, 1, 1]  # every segment, not only the last
    first, second = rows["split-1"]
    assert (first.prompt_ids, first.response_ids, second.prompt_ids) == ([1, 2, 3], [4, 5], [9, 8, 7, 6])
    assert [o.extra_fields["segment"] for o in rows["split-1"]] == [0, 1]
    assert all(o.extra_fields["min_global_steps"] == o.extra_fields["max_global_steps"] == 3
               and o.extra_fields["version_source"] == "calls" for r in rows.values() for o in r)

    _put(tq, v1_worker(config, loop.tokenizer), {"g-split": [rows["split-0"], rows["split-1"]],
                                                 "g-one": [rows["one-0"], rows["one-1"]]}, global_steps=4)
    batch, metrics, by_key = train_step(tq, config, uids=2, global_steps=4)
    assert sorted(batch.keys) == ["g-one_0_0", "g-one_1_0", "g-split_0_0", "g-split_0_1", "g-split_1_0", "g-split_1_1"]
    advantage = {k: float(a[0]) for k, (m, a) in by_key.items()}
    # V1's GRPO: each session's last row against its group, broadcast to the session's other rows
    assert advantage["g-split_1_0"] == pytest.approx(advantage["g-split_1_1"]) and advantage["g-split_1_1"] > 0
    assert advantage["g-split_0_0"] == pytest.approx(advantage["g-split_0_1"]) and advantage["g-split_0_1"] < 0
    assert metrics["training/off_policy/trajectory_staleness/max"] == 0  # (4 - 1) - 3: the step's own weights
    assert metrics["training/off_policy/trajectory_spans/max"] == 1
    assert metrics["response_length/mean"] == pytest.approx((2 + 3) * 2 / 6 + 3 * 2 / 6)  # every row counted
    tq.kv_clear(keys=[*batch.keys, "g-split", "g-one"], partition_id="train")


def test_a_mixed_batch_gives_gradient_only_to_its_good_rows_in_v1(tmp_path, transfer_queue):
    """A good try, a placeholder, a try without engine log-probs, an over-long prompt and failures: one V1 group."""
    from .test_verl_loop_rows import _store_tries as mixed_tries

    tq = transfer_queue
    names = ["good", "placeholder", "no_logprobs", "long", "model_failure", "infra_failure"]
    config = _config(tmp_path / "verl.db", n=len(names))
    loop = _loop(config)
    mixed_tries(loop.store)
    _put(tq, v1_worker(config, loop.tokenizer), {"mixed": [loop.output(lrl.trajectory(loop.store, rid))
                                                           for rid in names]}, global_steps=1)
    batch, _, by_key = train_step(tq, config, uids=1, global_steps=1)
    by_session = {int(k.split("_")[1]): v for k, v in by_key.items()}
    assert [int(by_session[i][0].sum()) for i in range(len(names))] == [2, 0, 0, 0, 2, 0]
    assert all(float((a * (m == 0)).abs().sum()) == 0 for m, a in by_session.values())  # no gradient where masked
    tq.kv_clear(keys=[*batch.keys, "mixed"], partition_id="train")


def test_the_weight_version_is_read_from_the_server_actor(transfer_queue):
    """verl's vLLM server actor keeps the version it serves in ``global_steps`` (``set_global_steps``, no getter)."""
    import ray

    @ray.remote(num_cpus=0)
    class Server:
        def __init__(self):
            self.global_steps = None

        def set_global_steps(self, global_steps):
            self.global_steps = global_steps

    handle = Server.remote()
    assert asyncio.run(loop_module.server_version(handle)) is None  # before the first sync
    ray.get(handle.set_global_steps.remote(7))
    assert asyncio.run(loop_module.server_version(handle)) == 7
    assert asyncio.run(loop_module.server_version(None)) is None  # a standalone server (lightning_rl.server_url)
    ray.kill(handle)
