"""The viewer (``lightning-rl view``) in a real headless browser: Debian's chromium driven by Playwright
(``executable_path``; nothing downloaded). The store is a real SQLite file holding a calculator rollout
whose token ids come from the tiny model's own tokenizer and chat template, so the trained sample has
real tool tokens to mask. ``make screenshots`` also saves each page to docs/images (the README shows them)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.records import Reward, RewardSource, Rollout, RolloutStatus, Span, SpanTokens
from lightning_rl.store.sqlite.store import SQLiteStore

from ..conftest import ensure_tiny_model

pytest.importorskip("fastapi")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]


def _span(rid: str, seq: int, span_id: int, name: str, attrs: dict, start: int, end: int,
          tokens: SpanTokens | None = None, parent: int | None = 1) -> Span:
    return Span(rollout_id=rid, seq=seq, trace_id="%032x" % 7, span_id="%016x" % span_id,
                parent_id=None if parent is None else "%016x" % parent, name=name,
                kind="CLIENT" if tokens else "INTERNAL", start_ns=start, end_ns=end, attributes=attrs, tokens=tokens)


def calculator_rollout(store: SQLiteStore, tokenizer, rid: str, group: str, attempt: int, answer: str,
                       reward: float | None, start: float) -> None:
    """Two LLM calls around a calculator call, as the tracer records them, with the chat template's ids:
    the second prompt is the first prompt, the first answer and the tool message, so the trajectory's
    sample masks the tool message's tokens."""
    system, user = {"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 2+2?"}
    call = {"id": f"call_{rid}", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}
    said = {"role": "assistant", "content": "", "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": call["id"], "content": answer}
    p0 = tokenizer.encode(tokenizer.apply_chat_template([system, user], tools=TOOLS, add_generation_prompt=True,
                                                        tokenize=False))
    r0 = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call><|im_end|>')
    observation = tokenizer.encode(f"\n<|im_start|>user\n<tool_response>\n{answer}\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n")
    p1 = list(p0) + r0 + observation
    r1 = tokenizer.encode(f"{answer}<|im_end|>")
    store.start_rollout(Rollout(rollout_id=rid, name="calculator", agent="calculator", task={"a": 2, "b": 2},
                                group_id=group, attempt=attempt, policy_version=3, start_time=start))
    ns = int(start * 1e9)

    def llm(seq: int, index: int, messages: list, output: dict, prompt: list, response: list, t0: int, t1: int) -> Span:
        logprobs = [round(-0.05 - 0.9 * ((i * 7919) % 5), 3) for i in range(len(response))]
        return _span(rid, seq, 10 + seq, "chat tiny", {
            semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_REQUEST_MODEL: "tiny", semconv.ROLLOUT_ID: rid,
            semconv.LLM_CALL_INDEX: index, semconv.POLICY_VERSION: 3, semconv.GEN_AI_AGENT_NAME: "calculator",
            semconv.TOKEN_IDS_SOURCE: "engine", semconv.GEN_AI_INPUT_MESSAGES: json.dumps(messages),
            semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps([output])}, ns + t0, ns + t1,
            SpanTokens(prompt_ids=list(prompt), response_ids=response, response_logprobs=logprobs))

    store.add_spans([
        _span(rid, 0, 1, "invoke_agent calculator", {semconv.GEN_AI_OPERATION_NAME: "invoke_agent",
                                                     semconv.ROLLOUT_ID: rid}, ns, ns + 90_000_000, parent=None),
        llm(1, 0, [system, user], said, p0, r0, 1_000_000, 40_000_000),
        _span(rid, 2, 3, "execute_tool calculator", {semconv.GEN_AI_OPERATION_NAME: "execute_tool",
                                                     semconv.GEN_AI_TOOL_NAME: "calculator",
                                                     semconv.GEN_AI_TOOL_CALL_ID: call["id"], semconv.ROLLOUT_ID: rid},
              ns + 41_000_000, ns + 45_000_000),
        llm(4, 1, [system, user, said, tool], {"role": "assistant", "content": answer}, p1, r1, 46_000_000, 88_000_000),
    ])
    if reward is not None:
        store.write_reward(Reward(rollout_id=rid, value=reward, source=RewardSource.RETURNED, time=start + 0.09))
    store.finish_rollout(rid, RolloutStatus.SUCCEEDED, start + 0.09, None)


@pytest.fixture(scope="module")
def viewed(tmp_path_factory):
    from transformers import AutoTokenizer

    from lightning_rl.viewer import BackgroundViewer

    model = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    root = tmp_path_factory.mktemp("viewer")
    store = SQLiteStore(root / "runs.db")
    now = time.time() - 600
    for i, (answer, reward) in enumerate([("4", 1.0), ("5", 0.0), ("4", 1.0), ("22", 0.0)]):
        calculator_rollout(store, tokenizer, f"calc{i}", "group-2plus2", i, answer, reward, now + i)
    for i in range(60):  # enough for two pages of other rollouts
        store.start_rollout(Rollout(rollout_id=f"other{i:02d}", name="other", agent="planner" if i % 2 else "solver",
                                    task={"q": f"question {i}"}, mode="eval" if i % 3 == 0 else "train",
                                    group_id=f"g{i // 4}", start_time=now - 100 + i))
        store.finish_rollout(f"other{i:02d}", RolloutStatus.FAILED if i % 5 == 0 else RolloutStatus.SUCCEEDED,
                             now - 99 + i, "ValueError: the agent gave up" if i % 5 == 0 else None)
        store.write_reward(Reward(rollout_id=f"other{i:02d}", value=(i % 4) / 4, source=RewardSource.RETURNED))
    store.flush()
    store.add_reward("calc0", 0.5, name="user_feedback")  # late feedback, after the rollout ended
    run = root / "runs" / "demo"
    run.mkdir(parents=True)
    lines = [{"step": 0, "eval_success": 0.1, "policy_version": 0}]
    lines += [{"step": s, "train_reward": 0.1 * s, "loss": -0.3 / s, "pg_clipfrac": 0.01 * s, "staleness": {"0": 6, "1": 2},
               "engine_logprob_gap": 1e-7 * s, "policy_version": s} for s in range(1, 6)]
    lines += [{"step": 5, "eval_success": 0.9, "policy_version": 5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    team = root / "runs" / "team"
    team.mkdir()
    (team / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train_reward": 0.2 * s, "policies": {
        "planner-lora": {"loss": -0.1 * s, "pg_clipfrac": 0.02}, "solver-lora": {"loss": -0.2 * s, "pg_clipfrac": 0.03}}})
        + "\n" for s in range(1, 4)))
    with BackgroundViewer(store, metrics_dir=root / "runs", tokenizer=model) as viewer:
        yield viewer, store
    store.close()


def test_pages_answer_over_plain_http(viewed):
    import httpx

    viewer, _ = viewed
    page = httpx.get(viewer.url + "/", params={"mode": "train", "sort": "reward", "order": "desc", "per_page": 10})
    assert page.status_code == 200 and page.text.count("data-rollout=") == 10
    assert httpx.get(viewer.url + "/", params={"reward_min": "lots"}).status_code == 422  # named, not a 500
    assert "reward_min must be a float" in httpx.get(viewer.url + "/", params={"reward_min": "lots"}).text
    assert httpx.get(viewer.url + "/rollouts/nope").status_code == 404
    group = httpx.get(viewer.url + "/groups/group-2plus2").text
    # GRPO over rewards 1, 0, 1, 0: mean 0.5, std 0.577 (unbiased) -> +-0.866, as the trainer computes it
    assert group.count("class='num advantage'>0.866<") == 2 and group.count("class='num advantage'>-0.866<") == 2


def test_each_prompt_token_is_shown_once_so_a_long_rollouts_page_stays_linear(viewed):
    import httpx

    viewer, store = viewed
    first, second = lrl.trajectory(store, "calc0").llm_calls
    shared = len(first.prompt_token_ids) + len(first.response_token_ids)
    assert second.prompt_token_ids[:shared] == first.prompt_token_ids + first.response_token_ids
    page = httpx.get(viewer.url + "/rollouts/calc0").text
    assert f"prompt ({len(second.prompt_token_ids)} tokens; the first {shared} are call {first.index}" in page
    shown = page.count("<span class='tok prompt'")
    assert shown == len(first.prompt_token_ids) + len(second.prompt_token_ids) - shared


def test_token_is_required_beyond_loopback_and_checked(tmp_path):
    import httpx

    from lightning_rl.errors import ConfigurationError
    from lightning_rl.viewer import BackgroundViewer
    from lightning_rl.serving import VIEWER, check_bind

    with pytest.raises(ConfigurationError, match="--token or LIGHTNING_RL_VIEW_TOKEN"):
        check_bind(VIEWER, "0.0.0.0", None)
    store = SQLiteStore(tmp_path / "s.db")
    with BackgroundViewer(store, token="s3cret") as viewer:
        assert httpx.get(viewer.url + "/").status_code == 401
        assert httpx.get(viewer.url + "/", params={"token": "wrong"}).status_code == 401
        ok = httpx.get(viewer.url + "/", params={"token": "s3cret"}, follow_redirects=True)
        assert ok.status_code == 200 and "token" not in str(ok.url)  # the session is a cookie, not the URL
        assert "s3cret" not in (ok.history[0].cookies.get("lrl_view_token") or "s3cret")
        assert httpx.get(viewer.url + "/training", headers={"authorization": "Bearer s3cret"}).status_code == 200
    store.close()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium (apt-get install chromium; make browser)")
def test_in_a_browser_list_filter_rollout_tokens_rewards_group_and_training(viewed):
    sync_api = pytest.importorskip("playwright.sync_api")
    viewer, store = viewed
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    shots = os.environ.get("LIGHTNING_RL_VIEWER_SCREENSHOTS") == "1"  # make screenshots
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(viewer.url)
                   else route.abort())  # no page may need the network

        page.goto(viewer.url + "/")
        assert page.locator("#count").first.inner_text() == "1-50 of 64"
        if shots:
            page.screenshot(path=str(DOCS_IMAGES / "viewer-rollouts.png"))
        page.locator("#next").first.click()
        assert page.locator("#count").first.inner_text() == "51-64 of 64"

        # filter: failed rollouts of the planner agent -> every row says so
        page.goto(viewer.url + "/")
        page.select_option("select[name=status]", "failed")
        page.fill("input[name=agent]", "planner")
        page.click("button[type=submit]")
        rows = page.locator("#rollouts tbody tr")
        expected = sum(1 for i in range(60) if i % 5 == 0 and i % 2)
        assert rows.count() == expected and expected > 0
        assert all(t == "failed" for t in rows.locator("td:nth-child(3)").all_inner_texts())
        # sort by reward, highest first: the column reads in order
        page.goto(viewer.url + "/?mode=train")
        page.click("th a[data-sort=reward]")
        rewards = [float(x) for x in page.locator("#rollouts tbody td.reward").all_inner_texts() if x]
        assert rewards == sorted(rewards, reverse=True) and rewards[0] == 1.0

        # open a rollout from the list: conversation, tokens (masked tool tokens), rewards (late marked)
        page.fill("input[name=text]", "calc0")
        page.click("button[type=submit]")
        page.locator("#rollouts tbody a").first.click()
        assert page.locator("h1").inner_text() == "Rollout calc0"
        assert page.locator(".bubble[data-role=tool]").inner_text().endswith("4")
        assert "calculator" in page.locator(".bubble[data-role=assistant] .toolcall").first.inner_text()
        masked = page.locator(".sample-tokens .tok.masked")
        trajectory = lrl.trajectory(store, "calc0")
        from lightning_rl.store.training_samples import trajectory_samples

        (sample,) = trajectory_samples(trajectory, level="trajectory")[0]
        assert masked.count() == sample.response_mask.count(0) > 0  # the tool message's tokens, not trained
        assert "tool_response" in "".join(masked.all_inner_texts())  # real token text from the tokenizer
        trained = page.locator(".sample-tokens .tok:not(.masked)")
        assert trained.count() == sum(sample.response_mask)
        assert "log-prob" in trained.first.get_attribute("title")
        rewards = page.locator("#rewards tr")
        assert rewards.count() == 3  # header, returned, late feedback
        assert "late" in rewards.nth(2).inner_text() and "user_feedback" in rewards.nth(2).inner_text()
        assert "late" not in rewards.nth(1).inner_text()
        assert page.locator(".timeline .bar").count() == 4
        if shots:
            page.screenshot(path=str(DOCS_IMAGES / "viewer-rollout.png"), full_page=True)

        page.locator("a[href*='/groups/']").first.click()
        assert page.locator("#group tr").count() == 5
        if shots:
            page.screenshot(path=str(DOCS_IMAGES / "viewer-group.png"))

        page.click("header a[href^='/training']")
        assert page.locator(".chart").count() >= 5
        metrics = page.locator(".chart").evaluate_all("els => els.map(e => e.dataset.metric)")
        assert {"reward (train)", "success (held out)", "loss", "clip fraction", "staleness (mean versions behind)",
                "engine/trainer log-prob gap"} <= set(metrics)
        if shots:
            page.screenshot(path=str(DOCS_IMAGES / "viewer-training.png"), full_page=True)
        page.locator("#runs a", has_text="team").click()
        loss = page.locator(".chart[data-metric=loss]")
        assert "planner-lora" in loss.inner_text() and "solver-lora" in loss.inner_text()  # a curve per policy
        browser.close()


def test_the_training_page_lists_policy_decisions_and_draws_the_gate(viewed, tmp_path):
    """Issue 36: the gate's decisions, from the store, newest first; its figures as curves."""
    import httpx

    from lightning_rl.viewer.app import training_charts

    viewer, store = viewed
    figures = {"gate_mean_candidate": 0.25, "gate_mean_live": 0.75, "gate_lower_bound": -0.8125}
    store.record_decision("policy", 3, "refused", live_version=2, figures=figures, reason="lower bound -0.8125 < -0.1")
    store.record_decision("policy", 2, "rolled_back", live_version=3, reason="by hand")
    store.record_decision("policy", 4, "promoted", live_version=2, reason="canary", figures={
        "canary_mean_candidate": 0.5, "canary_mean_live": 0.375, "canary_lower_bound": -0.0625})
    store.record_decision("policy", 2, "rolled_back", live_version=4, reason="watch", figures={
        "watch_mean_candidate": 0.125, "watch_mean_live": 0.625, "watch_upper_bound": -0.3125})
    text = httpx.get(viewer.url + "/training").text
    table = text.split("id='decisions'", 1)[1]
    assert table.index("rolled_back") < table.index("refused")  # newest first
    assert "0.25 / 0.75" in table and "-0.8125" in table and "lower bound -0.8125 &lt; -0.1" in table
    assert "0.5 / 0.375" in table and "-0.0625" in table  # the canary's test
    assert "0.125 / 0.625" in table and "-0.3125" in table  # the watch's, its upper bound
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"version": v, "gate_lower_bound": b, "gate_promoted": int(b >= -0.1)}) + "\n"
                               for v, b in ((0, -0.4), (1, 0.0))))
    charts = training_charts(metrics)
    assert any("gate: lower bound" in c for c in charts) and any("gate: promoted" in c for c in charts)
