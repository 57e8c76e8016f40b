"""The group judge against the real vLLM server (the tiny model judging, guided to the score schema)."""

from __future__ import annotations

import json
import time

import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.errors import ConfigurationError
from lightning_rl.judge import SCALE, GroupJudge, response_format
from lightning_rl.records import Rollout, RolloutStatus
from lightning_rl.store.sqlite.store import SQLiteStore

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
        trajectory = lrl.trajectory(store, f"t{i}")
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


class HostedLike:
    """A front for the vLLM server that answers as hosted APIs do: a bearer key checked (401), a rate
    limit first (429 with Retry-After), OpenAI's refusal of ``max_tokens`` on newer models (400), and,
    when asked, the model's JSON fenced in prose, as a chat model without structured outputs writes it
    (the front has vLLM keep to the score schema, so what is inside the fence is deterministic). The
    scores themselves come from vLLM."""

    def __init__(self, upstream: str, *, key: str = "sk-test", limit_first: int = 1, fence: bool = False) -> None:
        import http.server
        import json
        import threading

        import httpx

        front = self
        self.bodies: list[dict] = []
        self.statuses: list[int] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, payload: dict, headers: dict | None = None) -> None:
                front.statuses.append(status)
                data = json.dumps(payload).encode()
                self.send_response(status)
                for k, v in {"content-type": "application/json", **(headers or {})}.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                front.bodies.append(body)
                if self.headers.get("authorization") != f"Bearer {key}":
                    return self._answer(401, {"error": {"message": "Incorrect API key provided"}})
                if "max_tokens" in body:
                    return self._answer(400, {"error": {"message": "Unsupported parameter: 'max_tokens' is not "
                                                                   "supported with this model. Use "
                                                                   "'max_completion_tokens' instead."}})
                if len(front.bodies) <= limit_first:
                    return self._answer(429, {"error": {"message": "Rate limit reached"}}, {"retry-after": "1"})
                if fence:
                    body = {**body, "response_format": response_format(len(ANSWERS))}
                reply = httpx.post(f"{upstream}/chat/completions", json=body, timeout=120).json()
                if fence:
                    message = reply["choices"][0]["message"]
                    message["content"] = f"Here are my scores:\n```json\n{message['content']}\n```\nHope that helps."
                self._answer(200, reply)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


TASK, ANSWERS = {"question": "What is 2+2?"}, ["4", "5", "22"]


def test_a_hosted_api_is_asked_as_openai_wants_and_its_rate_limit_retried(vllm_url, monkeypatch):
    """No hosted API is reachable from here; this front holds the judge to what one requires."""
    diagnostics.reset()
    direct, _ = GroupJudge(base_url=vllm_url, model=SERVED_NAME, rubric=RUBRIC).score(TASK, ANSWERS)
    front = HostedLike(vllm_url)
    try:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # the key comes from the environment, as OpenAI's SDK reads it
        judge = GroupJudge(base_url=front.url, model=SERVED_NAME, rubric=RUBRIC)
        started = time.monotonic()
        scores, info = judge.score(TASK, ANSWERS)
        assert scores == direct, info  # the same request, answered after the rate limit
        assert front.statuses == [429, 200] and judge.calls == 2 and time.monotonic() - started >= 1.0  # Retry-After
        assert diagnostics.counters()["judge_retries"] == 1 and "judge_failures" not in diagnostics.counters()
        body = front.bodies[-1]
        assert body["max_completion_tokens"] == 256 and "max_tokens" not in body
        assert body["response_format"]["json_schema"]["strict"] is True

        wrong = GroupJudge(base_url=front.url, model=SERVED_NAME, rubric=RUBRIC, api_key="sk-wrong")
        scores, info = wrong.score(TASK, ["4", "5"])
        assert scores is None and wrong.calls == 1  # a wrong key is not retried
        assert "401" in info["error"] and "Incorrect API key" in info["error"]
        assert diagnostics.counters()["judge_failures"] == 1
    finally:
        front.close()


def test_an_unguided_judge_reads_fenced_json_and_gives_up_after_its_retries(vllm_url):
    diagnostics.reset()
    direct, _ = GroupJudge(base_url=vllm_url, model=SERVED_NAME, rubric=RUBRIC).score(TASK, ANSWERS)
    front = HostedLike(vllm_url, fence=True, limit_first=0)
    try:  # guided=False, as for a provider without JSON-schema outputs: the scores are read out of the prose
        judge = GroupJudge(base_url=front.url, model=SERVED_NAME, rubric=RUBRIC, api_key="sk-test", guided=False)
        scores, info = judge.score(TASK, ANSWERS)
        assert "response_format" not in front.bodies[-1]
        assert scores == direct and info["error"] is None, info
    finally:
        front.close()
    limited = HostedLike(vllm_url, limit_first=10)
    try:
        judge = GroupJudge(base_url=limited.url, model=SERVED_NAME, rubric=RUBRIC, api_key="sk-test", retries=1)
        scores, info = judge.score(TASK, ANSWERS)
        assert scores is None and limited.statuses == [429, 429] and "429" in info["error"]
        assert diagnostics.counters()["judge_failures"] == 1 and diagnostics.counters()["judge_retries"] == 1
    finally:
        limited.close()
    with pytest.raises(ConfigurationError, match="retries must be an int >= 0"):
        GroupJudge(base_url=vllm_url, model=SERVED_NAME, retries=-1)


def test_the_judge_command_rewards_stored_groups_that_have_none(vllm_url, tmp_path):
    """After the fact, e.g. production traffic: each unrewarded group judged once, rewarded groups and
    other modes left alone, ungrouped tries counted; a second run finds nothing and says so."""
    from click.testing import CliRunner

    from lightning_rl.cli import main
    from lightning_rl.records import Reward, RewardSource

    store = SQLiteStore(tmp_path / "s.db")
    tries = {("p1", "prod"): ["4", "5"], ("p2", "prod"): ["4", "22"], ("done", "prod"): ["4"], ("t1", "train"): ["4"],
             (None, "prod"): ["4"]}
    for (group, mode), answers in tries.items():
        for i, answer in enumerate(answers):
            rid = f"{group}-{i}"
            store.start_rollout(Rollout(rollout_id=rid, name="calc", agent="calc", task=TASK, group_id=group,
                                        attempt=i, mode=mode))
            span = llm_span(rid, 0, 0, [1, 2], [3], agent="calc")
            span.attributes["gen_ai.output.messages"] = f'[{{"role": "assistant", "content": "{answer}"}}]'
            store.add_spans([span])
            store.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)
    store.write_reward(Reward(rollout_id="done-0", value=0.3, source=RewardSource.FEEDBACK))
    store.flush()
    store.close()

    def judge(*extra: str):
        return CliRunner().invoke(main, ["judge", "--store", str(tmp_path / "s.db"), "--base-url", vllm_url,
                                         "--model", SERVED_NAME, "--rubric", RUBRIC, "--mode", "prod", *extra])

    result = judge()
    assert result.exit_code == 0, result.output
    line = json.loads(result.output.strip().splitlines()[-1])
    assert line == {"judged_groups": 2, "judge_failed_groups": 0, "judge_rewarded_rollouts": 4,
                    "ungrouped_skipped": 1, "judge_requests": 2}
    store = SQLiteStore(tmp_path / "s.db")
    for rid in ("p1-0", "p1-1", "p2-0", "p2-1"):
        (reward,) = store.rewards(rid)
        assert reward.value in SCALE and reward.source.value == "function"
    assert [r.value for r in store.rewards("done-0")] == [0.3]  # a reward given is never overwritten
    assert store.rewards("t1-0") == [] and store.rewards("None-0") == []  # another mode; no group
    store.close()
    again = judge()
    assert again.exit_code == 1 and "no group of succeeded rollouts without a reward in mode prod" in again.output
    assert "1 unrewarded rollouts have no group" in again.output
