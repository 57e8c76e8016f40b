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
from .verl_v1 import compose_config, train_step, transfer_queue, v1_worker, verls_grpo, within  # noqa: F401 - a fixture

pytestmark = [pytest.mark.verl, pytest.mark.ray]
pytest.importorskip("verl")
pytest.importorskip("transfer_queue")
loop_module = pytest.importorskip("lightning_rl.trainer_bridge.verl.agent_loop")

AGENT = "tests.trainer_bridge.verl_agents:two_turn_solver"


def _config(db, n=2, **lightning):
    return compose_config(db, prompt_length=16, response_length=12, n=n, agent=AGENT,
                          server_url="http://127.0.0.1:9/v1", **lightning)


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
    """A good try, a placeholder, a try without engine log-probs, a long prompt and a model failure: one V1 group,
    whose advantages are verl's own GRPO's; a good try beside an infrastructure failure: another group, which
    leaves the batch (advantage 0, response mask 0) without changing the first group's advantages."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from .test_verl_loop_rows import _store_tries as mixed_tries

    tq = transfer_queue
    names = ["good", "placeholder", "no_logprobs", "long", "model_failure"]
    config = _config(tmp_path / "verl.db", n=len(names))
    loop = _loop(config)
    mixed_tries(loop.store)
    out = {rid: loop.output(lrl.trajectory(loop.store, rid)) for rid in [*names, "infra_failure"]}
    groups = {"mixed": [out[rid] for rid in names], "failed": [out["good"], out["infra_failure"]]}
    worker = v1_worker(config, loop.tokenizer)
    _put(tq, worker, groups, global_steps=1)
    batch, metrics, by_key = train_step(tq, config, uids=2, global_steps=1)
    mixed = {int(k.split("_")[1]): v for k, v in by_key.items() if k.startswith("mixed_")}
    assert [int(mixed[i][0].sum()) for i in range(len(names))] == [2, 0, 0, 2, 2]
    assert all(float((a * (m == 0)).abs().sum()) == 0 for m, a in mixed.values())  # no gradient where masked
    failed = [v for k, v in by_key.items() if k.startswith("failed_")]
    assert len(failed) == 2 and all(int(m.sum()) == 0 and float(a.abs().sum()) == 0 for m, a in failed)
    assert (metrics["lightning_rl/groups_dropped_infra"], metrics["lightning_rl/tries_dropped_infra"]) == (1, 2)
    # the kept group's advantages are those verl's own GRPO computes for it alone
    verl = verls_grpo(tq, config, sorted(k for k in by_key if k.startswith("mixed_")))
    for key, theirs in verl.items():
        assert by_key[key][1][: len(theirs)].tolist() == pytest.approx(theirs[: len(by_key[key][1])].tolist(), abs=1e-5)
    tq.kv_clear(keys=[*batch.keys, "mixed", "failed"], partition_id="train")

    # the same rows under verl's own step: the failed try's 0.0 enters its group's mean, the good try's advantage
    # moves (reproduces issue 54's first defect)
    _put(tq, worker, groups, global_steps=1)
    batch, _, theirs = train_step(tq, config, uids=2, global_steps=1, advantage=PPOTrainer._compute_advantage)
    good = [v for k, v in theirs.items() if k.startswith("failed_0")]
    assert float(good[0][1].abs().sum()) > 0  # the good try of the failed group trains under plain verl
    tq.kv_clear(keys=[*batch.keys, "mixed", "failed"], partition_id="train")


def test_a_batch_with_nothing_to_train_is_counted_and_its_update_skipped(tmp_path, transfer_queue):
    """Every group with an infrastructure failure: no token is left to train on. verl's rollout correction raises on
    such a batch and its token-mean loss would divide 0 by 0: the step counts it and the trainer skips the update."""
    from types import SimpleNamespace

    from .test_verl_loop_rows import _store_tries as mixed_tries

    tq = transfer_queue
    config = _config(tmp_path / "verl.db")
    loop = _loop(config)
    mixed_tries(loop.store)
    out = {rid: loop.output(lrl.trajectory(loop.store, rid)) for rid in ("good", "infra_failure")}
    _put(tq, v1_worker(config, loop.tokenizer), {"all-failed": [out["good"], out["infra_failure"]]}, global_steps=1)
    trainer = {}

    def advantage(t, batch, metrics):
        from lightning_rl.trainer_bridge.verl.advantage import compute_advantage

        batch = compute_advantage(t, batch, metrics)
        trainer["tokens"] = t.lightning_rl_trained_tokens
        return batch

    batch, metrics, by_key = train_step(tq, config, uids=1, global_steps=1, advantage=advantage)
    assert trainer["tokens"] == 0 and metrics["lightning_rl/trained_tokens"] == 0
    assert all(int(m.sum()) == 0 and float(a.abs().sum()) == 0 for m, a in by_key.values())
    from lightning_rl.trainer_bridge.verl.trainer import LightningRLSyncTrainer

    skipped: dict = {}
    stub = SimpleNamespace(lightning_rl_trained_tokens=0, global_steps=1)
    assert LightningRLSyncTrainer._update_actor(stub, batch, skipped) is batch  # verl's update never called
    assert skipped["lightning_rl/update_skipped"] == 1
    tq.kv_clear(keys=[*batch.keys, "all-failed"], partition_id="train")


def test_per_segment_credit_reaches_the_advantage_in_v1(tmp_path, transfer_queue):
    """``credit=per_step``: each segment's own reward after credit. verl's worker copies the last row's reward over
    the earlier ones and its GRPO gives every row the last one's advantage; ours gives each row its own."""
    tq = transfer_queue
    config = _config(tmp_path / "verl.db", credit="per_step")
    loop = _loop(config)
    _tries(loop.store)
    store = loop.store
    store.write_reward(Reward(rollout_id="split-1", value=0.5, llm_call_index=0, source=RewardSource.EMITTED))
    store.flush()
    rows = {rid: loop.output(lrl.trajectory(store, rid, credit="per_step")) for rid in ("split-0", "split-1")}
    assert rows["split-1"][0].extra_fields["segment_reward"] != rows["split-1"][1].extra_fields["segment_reward"]
    _put(tq, v1_worker(config, loop.tokenizer), {"g-split": [rows["split-0"], rows["split-1"]]}, global_steps=1)
    batch, _, by_key = train_step(tq, config, uids=1, global_steps=1)
    first, last = float(by_key["g-split_1_0"][1][0]), float(by_key["g-split_1_1"][1][0])
    assert first != pytest.approx(last)  # each segment its own advantage
    verl = verls_grpo(tq, config, sorted(by_key))
    assert float(verl["g-split_1_0"][0]) == pytest.approx(float(verl["g-split_1_1"][0]))  # verl alone: the last's
    tq.kv_clear(keys=[*batch.keys, "g-split"], partition_id="train")


def test_a_masked_last_segment_leaves_the_try_its_other_segments_gradient_in_v1(tmp_path, transfer_queue):
    """A try whose last segment has no gradient (its engine log-probs missing, say): verl's own GRPO reads the try's
    advantage from that row at its first unmasked token, so every segment of the try gets 0 while its reward counts
    in the group (reproduced here through verl's code); ours keeps the first segment's advantage."""
    tq = transfer_queue
    config = _config(tmp_path / "verl.db")
    loop = _loop(config)
    _tries(loop.store)
    rows = {rid: loop.output(lrl.trajectory(loop.store, rid)) for rid in ("split-0", "split-1")}
    last = rows["split-1"][1]
    last.response_mask = [0] * len(last.response_ids)
    last.extra_fields["masked"] = "no_engine_logprobs"
    _put(tq, v1_worker(config, loop.tokenizer), {"g-split": [rows["split-0"], rows["split-1"]]}, global_steps=1)
    batch, _, ours = train_step(tq, config, uids=1, global_steps=1)
    verl = verls_grpo(tq, config, sorted(ours))
    assert float(verl["g-split_1_0"].abs().sum()) == 0  # verl alone: the try's first segment trains nothing
    assert float(ours["g-split_1_0"][1][0]) > 0 and float(ours["g-split_1_1"][1].abs().sum()) == 0
    assert float(ours["g-split_0_0"][1][0]) == pytest.approx(-float(ours["g-split_1_0"][1][0]))
    tq.kv_clear(keys=[*batch.keys, "g-split"], partition_id="train")


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
