"""The rows the verl agent loop hands verl (``verl_rows``), and the settings the launch refuses: no verl needed."""

from __future__ import annotations

import time

import pytest

import lightning_rl as lrl
from lightning_rl.records import Reward, RewardSource, RolloutStatus
from lightning_rl.trainer_bridge.verl.launch import check_verl_config, served_model_name
from lightning_rl.trainer_bridge.verl.rows import rollout_rows

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
    return rollout_rows(traj, response_length=6, pad_token_id=0, **kw)


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
    # verl copies the last row's reward_score over the others: each row's own travels in its extra fields
    assert [r.extra_fields["segment_reward"] for r in rows] == [credited[1], credited[2]]
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
    # V1 takes rows unpadded: a long prompt is kept whole, with gradient (it was cut and masked before: a masked
    # last segment gave its whole try advantage 0 under verl's GRPO)
    long = _rows(_stored(store, "long", [llm_span("long", 0, 0, list(range(1, 21)), [4, 5])]))
    assert long[0].extra_fields["masked"] == "" and long[0].prompt_ids == list(range(1, 21))
    assert long[0].response_mask == [1, 1]
    infra = _rows(_stored(store, "infra", [llm_span("infra", 0, 0, [1], [2]), llm_span("infra", 1, 1, [9], [8])],
                          status=RolloutStatus.FAILED, error="APIConnectionError: refused", reward=None))
    assert [r.extra_fields["masked"] for r in infra] == ["infra_failure"] * 2 and {r.reward_score for r in infra} == {0.0}
    assert all(sum(r.response_mask) == 0 for r in infra) and {r.extra_fields["failure"] for r in infra} == {"infra"}
    store.close()


def test_a_segment_sampled_under_a_grammar_has_no_gradient(tmp_path):
    """vLLM's log-probs of a grammar-masked sample are of the masked distribution, which verl's actor does not
    compute (a 0.28 log-prob gap measured, docs/verl.md): such a segment keeps its reward, without gradient."""
    from lightning_rl.capture.exchange import guided_decoding

    store = lrl.open_store(f"sqlite:///{tmp_path / 'rows.db'}")
    spans = [llm_span("g", 0, 0, [1, 2], [3, 4]), llm_span("g", 1, 1, [7, 7], [8, 9])]
    spans[1].attributes["lightning_rl.sampling_params"] = '{"guided": "tool_choice"}'
    rows = _rows(_stored(store, "g", spans))
    assert [r.extra_fields["masked"] for r in rows] == ["", "guided_decoding"]
    assert rows[0].response_mask == [1, 1] and rows[1].response_mask == [0, 0] and rows[1].reward_score == 1.0
    assert guided_decoding({"tool_choice": {"type": "function", "function": {"name": "calc"}}}) == "tool_choice"
    assert guided_decoding({"tool_choice": "required"}) == "tool_choice"
    assert guided_decoding({"structured_outputs": {"regex": "a+"}}) == "structured_outputs"
    assert guided_decoding({"response_format": {"type": "json_schema", "json_schema": {}}}) == "response_format:json_schema"
    assert guided_decoding({"tool_choice": "auto", "response_format": {"type": "text"}}) is None
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
    ({"algorithm": {"adv_estimator": "gae"}}, "GRPO only; use algorithm.adv_estimator=grpo"),
    ({"algorithm": {"adv_estimator": "rloo"}}, "use algorithm.adv_estimator=grpo"),
    ({"algorithm": {"use_kl_in_reward": True}}, "algorithm.use_kl_in_reward=true"),
    ({"reward": {"reward_model": {"enable": True}}}, "reward.reward_model.enable=true"),
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


def test_each_verl_run_numbers_its_versions_after_the_ones_in_the_store(tmp_path, monkeypatch):
    """verl counts global steps from 0 in every run: a run's version base keeps two runs of one served name in one
    store from publishing the same numbers; a resumed run keeps its base (its run record)."""
    import json

    from lightning_rl.trainer_bridge.verl.runs import RUN_RECORD, new_version_base, version_base

    store = lrl.open_store(f"sqlite:///{tmp_path / 'runs.db'}")
    assert new_version_base(store, "/models/tiny", str(tmp_path / "run1")) == 0
    for v in range(3):  # the first run's publishes: base 0 + steps 0..2
        store.record_policy("/models/tiny", v)
    store.record_policy("/models/other", 9)
    assert new_version_base(store, "/models/tiny", str(tmp_path / "run2")) == 3
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / RUN_RECORD).write_text(json.dumps({"model_path": "/models/tiny", "version_base": 0}))
    assert new_version_base(store, "/models/tiny", str(tmp_path / "run1")) == 0  # resumed: its own base
    monkeypatch.setenv("LIGHTNING_RL_VERL_VERSION_BASE", "3")
    assert version_base() == 3
    # the rows verl reads keep verl's own steps: a call stamped 3 + 1 is global step 1
    rows = _rows(_stored(store, "r", [llm_span("r", 0, 0, [1, 2], [3], policy_version=4)]), version_base=3)
    assert (rows[0].extra_fields["min_global_steps"], rows[0].extra_fields["version_source"]) == (1, "calls")
    store.close()
