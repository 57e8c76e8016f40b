"""The rows the verl agent loop hands verl (``verl_rows``), and the settings the launch refuses: no verl needed."""

from __future__ import annotations

import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import Reward, RewardSource, RolloutStatus
from lightning_rl.trainer_bridge.verl_launch import check_verl_config, served_model_name
from lightning_rl.trainer_bridge.verl_rows import rollout_rows

from ..store.helpers import llm_span, rollout


def _stored(store, rid, spans, *, status=RolloutStatus.SUCCEEDED, error=None, reward=1.0):
    store.start_rollout(rollout(rid, group_id="g"))
    store.add_spans(spans)
    if reward is not None:
        store.write_reward(Reward(rollout_id=rid, value=reward, source=RewardSource.RETURNED))
    store.finish_rollout(rid, status, time.time(), error)
    store.flush()
    return lrl.trajectory(store, rid, credit="per_step")


def _rows(traj, **kw):
    return rollout_rows(traj, prompt_length=8, response_length=6, pad_token_id=0, **kw)


def test_each_segment_of_a_broken_prefix_is_a_row_with_its_own_reward(tmp_path):
    store = lrl.open_store(f"sqlite:///{tmp_path / 'rows.db'}")
    spans = [llm_span("r", 0, 0, [1, 2], [3, 4], policy_version=2),
             llm_span("r", 1, 1, [1, 2, 3, 4, 5], [6], policy_version=2),  # extends the first: same segment
             llm_span("r", 2, 2, [7, 7, 7], [8, 9], policy_version=3)]  # the prefix broke (a re-rendered template)
    store.write_reward(Reward(rollout_id="r", value=0.25, llm_call_index=1, source=RewardSource.EMITTED))
    traj = _stored(store, "r", spans, reward=1.0)
    rows = _rows(traj)
    assert len(rows) == 2 and [r.extra_fields["segment"] for r in rows] == [0, 1]
    first, second = rows
    assert first.prompt_ids == [1, 2] and first.response_ids == [3, 4, 5, 6] and first.response_mask == [1, 1, 0, 1]
    assert second.prompt_ids == [7, 7, 7] and second.response_ids == [8, 9]
    credited = [c.reward for c in traj.llm_calls]  # per_step credit: each call's own
    assert (first.reward_score, second.reward_score) == (credited[1], credited[2]) and credited[1] != credited[2]
    assert [r.extra_fields["prefix_splits"] for r in rows] == [1, 1] and rows[0].extra_fields["segments"] == 2
    # versions from the calls each segment holds
    assert [(r.extra_fields["min_global_steps"], r.extra_fields["max_global_steps"]) for r in rows] == [(2, 2), (3, 3)]
    assert {r.extra_fields["version_source"] for r in rows} == {"calls"}
    # the server's reading wins; without calls' versions, the step's weights (V1 sync: the previous step's sync)
    assert {(r.extra_fields["min_global_steps"], r.extra_fields["max_global_steps"])
            for r in _rows(lrl.trajectory(store, "r"), versions=(5, 6))} == {(5, 6)}
    store.close()


def test_rows_that_must_not_train_keep_their_shape_with_the_reason(tmp_path):
    store = lrl.open_store(f"sqlite:///{tmp_path / 'rows.db'}")
    placeholder = _rows(_stored(store, "empty", [], status=RolloutStatus.FAILED, error="ValueError: no call",
                                reward=None), failure_reward=-0.5, global_steps=4)
    assert len(placeholder) == 1 and placeholder[0].extra_fields["masked"] == "no_sample"
    assert placeholder[0].reward_score == -0.5 and placeholder[0].extra_fields["failure"] == "model"
    assert placeholder[0].extra_fields["min_global_steps"] == 3 and placeholder[0].extra_fields["version_source"] == "step"
    long = _rows(_stored(store, "long", [llm_span("long", 0, 0, list(range(1, 21)), [4, 5])]))
    assert long[0].extra_fields["masked"] == "prompt_too_long" and long[0].prompt_ids == list(range(13, 21))
    assert long[0].response_mask == [0, 0]
    infra = _rows(_stored(store, "infra", [llm_span("infra", 0, 0, [1], [2]), llm_span("infra", 1, 1, [9], [8])],
                          status=RolloutStatus.FAILED, error="APIConnectionError: refused", reward=None))
    assert [r.extra_fields["masked"] for r in infra] == ["infra_failure"] * 2 and {r.reward_score for r in infra} == {0.0}
    assert all(sum(r.response_mask) == 0 for r in infra)
    store.close()


@pytest.mark.parametrize(("setting", "named"), [
    ({"trainer": {"use_v1": False}}, "trainer.use_v1=false"),
    ({"trainer": {"v1": {"trainer_mode": "colocate_async"}}}, "trainer.v1.trainer_mode=colocate_async"),
    ({"trainer": {"v1": {"trainer_mode": "separate_async"}}}, "use trainer.v1.trainer_mode=sync"),
    ({"actor_rollout_ref": {"rollout": {"name": "sglang"}}}, "actor_rollout_ref.rollout.name=sglang"),
    ({"actor_rollout_ref": {"rollout": {"mode": "sync"}}}, "actor_rollout_ref.rollout.mode=async"),
    ({"actor_rollout_ref": {"model": {"lora_rank": 16, "lora": {"merge": False}}}}, "lora.merge=true"),
    ({"actor_rollout_ref": {"model": {"lora": {"rank": 8}}}}, "LoRA rank 8"),
    ({"trainer": {"nnodes": 2}, "lightning_rl": {"store": "sqlite:///runs.db"}}, "2 nodes"),
])
def test_a_setting_that_would_lose_rows_or_train_the_wrong_weights_is_refused_in_one_line(setting, named):
    with pytest.raises(lrl.ConfigurationError, match=named.replace(".", r"\.")) as raised:
        check_verl_config(setting)
    assert "\n" not in str(raised.value)


def test_what_is_accepted_and_the_served_name():
    check_verl_config({})  # verl's defaults: V1, sync, vLLM, async rollout, no LoRA
    check_verl_config({"actor_rollout_ref": {"model": {"lora": {"rank": 8, "merge": True}}}})
    check_verl_config({"trainer": {"nnodes": 2}, "lightning_rl": {"store": "http://head:8765"}})
    assert served_model_name({"actor_rollout_ref": {"model": {"path": "/models/qwen"}}}) == "/models/qwen"
    assert served_model_name({"actor_rollout_ref": {"model": {"path": "/m/q"}, "rollout": {"prometheus": {
        "enable": True, "served_model_name": "org/policy"}}}}) == "policy"
