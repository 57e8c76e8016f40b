"""The group judge against the real vLLM server (the tiny model judging, guided to the score schema)."""

from __future__ import annotations

import time

import pytest

from lightning_rl import diagnostics
from lightning_rl.judge import SCALE, GroupJudge
from lightning_rl.records import Rollout, RolloutStatus
from lightning_rl.store.sqlite_store import SQLiteStore

from .conftest import SERVED_NAME
from .store.helpers import llm_span

pytestmark = pytest.mark.vllm
RUBRIC = "The task is an addition. Score 1 for the exact sum, 0 otherwise."


def _group(store: SQLiteStore, answers: list[str]) -> None:
    for i, answer in enumerate(answers):
        rid = f"t{i}"
        store.start_rollout(Rollout(rollout_id=rid, name="calc", agent="calc", task={"question": "What is 2+2?"},
                                    group_id="g", attempt=i))
        span = llm_span(rid, 0, 0, [1, 2], [3], agent="calc")
        span.attributes["gen_ai.output.messages"] = f'[{{"role": "assistant", "content": "{answer}"}}]'
        store.add_spans([span])
        store.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)
    store.flush()


def test_a_group_is_scored_once_cached_and_rewarded_with_judge_spans(vllm_url, tmp_path):
    diagnostics.reset()
    judge = GroupJudge(base_url=vllm_url, model=SERVED_NAME, rubric=RUBRIC, cache_path=tmp_path / "cache.json")
    scores, info = judge.score({"question": "What is 2+2?"}, ["4", "5", "22"])
    assert scores is not None and len(scores) == 3 and all(s in SCALE for s in scores), info
    again, info = judge.score({"question": "What is 2+2?"}, ["4", "5", "22"])
    assert again == scores and info["cached"] and judge.calls == 1
    assert GroupJudge(base_url=vllm_url, model=SERVED_NAME, rubric=RUBRIC,  # the cache file outlives the judge
                      cache_path=tmp_path / "cache.json").score({"question": "What is 2+2?"}, ["4", "5", "22"])[1]["cached"]

    store = SQLiteStore(tmp_path / "s.db")
    _group(store, ["4", "5", "22"])
    done = judge.reward_groups(store, ["g"])
    assert done == {"judged_groups": 1, "judge_failed_groups": 0, "judge_rewarded_rollouts": 3}
    for i in range(3):
        (reward,) = store.rewards(f"t{i}")
        assert reward.source.value == "function" and reward.value == scores[i]
        trajectory = store.trajectory(f"t{i}")
        assert len(trajectory.llm_calls) == 1  # the judge's call is not a training sample
        (span,) = [s for s in store.spans(f"t{i}") if s.attributes.get("gen_ai.operation.name") == "judge"]
        assert span.attributes["lightning_rl.judge.score"] == scores[i] and span.attributes["lightning_rl.judge.cached"]
    assert judge.reward_groups(store, ["g"]) == {"judged_groups": 0, "judge_failed_groups": 0,
                                                 "judge_rewarded_rollouts": 0}  # rewarded already: not again
    store.close()


@pytest.mark.parametrize("how", ["truncated", "unreachable"])
def test_a_judge_that_fails_leaves_the_group_unrewarded_and_counted(vllm_url, tmp_path, how):
    diagnostics.reset()
    url = vllm_url if how == "truncated" else "http://127.0.0.1:9/v1"
    judge = GroupJudge(base_url=url, model=SERVED_NAME, rubric=RUBRIC, max_tokens=3, timeout=30)  # 3 tokens: cut JSON
    store = SQLiteStore(tmp_path / "s.db")
    _group(store, ["4", "5"])
    done = judge.reward_groups(store, ["g"])
    assert done == {"judged_groups": 0, "judge_failed_groups": 1, "judge_rewarded_rollouts": 0}
    assert diagnostics.counters()["judge_failures"] == 1
    for i in range(2):
        assert store.rewards(f"t{i}") == []  # unrewarded, never a silent 0
        (span,) = [s for s in store.spans(f"t{i}") if s.attributes.get("gen_ai.operation.name") == "judge"]
        assert span.status_code == "ERROR" and span.status_message
    store.close()


def test_trainer_trains_on_the_judges_rewards_where_the_task_set_has_none(vllm_url, tmp_path):
    """A stored run whose tries have no reward, replayed through Trainer(judge=...): the judge rewards them
    before the samples are built, and the update trains on those rewards."""
    pytest.importorskip("peft")
    from lightning_rl.trainer_bridge.local import LocalConfig
    from lightning_rl.trainer_bridge.sources import StoredGroups
    from lightning_rl.trainer_bridge.trainer import Trainer

    from .conftest import ensure_tiny_model

    store = SQLiteStore(tmp_path / "run.db")
    store.enqueue({"question": "What is 2+2?"}, n=3)
    for i, entry in enumerate(store.lease("runner", limit=3)):
        store.start_rollout(Rollout(rollout_id=entry.rollout_id, name="calc", agent="calc", task=entry.task,
                                    group_id=entry.group_id, attempt=entry.attempt))
        span = llm_span(entry.rollout_id, 0, 0, [1, 2, 3], [4, 5 + i], agent="calc")
        span.attributes["gen_ai.output.messages"] = f'[{{"role": "assistant", "content": "{("4", "5", "22")[i]}"}}]'
        store.add_spans([span])
        store.finish_rollout(entry.rollout_id, RolloutStatus.SUCCEEDED, time.time(), None)
        store.complete(entry.queue_id, "runner", "succeeded")
    store.flush()
    judge = GroupJudge(base_url=vllm_url, model=SERVED_NAME, rubric=RUBRIC)
    trainer = Trainer(agent=None, tasks=(), store=store, model_dir=ensure_tiny_model(), server_url=None,
                      out_dir=tmp_path / "out", source=StoredGroups(store, tasks_per_step=1), judge=judge,
                      progress=False, local=LocalConfig(adv_estimator="batch_baseline"))
    (line,) = trainer.fit().history
    assert line["judged_groups"] == 1 and line["judge_rewarded_rollouts"] == 3
    assert line["unrewarded_samples"] == 0 and line["samples"] == 3  # every try trained, on the judge's score
    scored = sorted(r.value for rid in [e.rollout_id for e in store.queue_entries()] for r in store.rewards(rid))
    assert line["train_reward"] == pytest.approx(sum(scored) / 3)
    store.close()
