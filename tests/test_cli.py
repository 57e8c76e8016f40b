"""The lightning-rl command, run in-process on a real SQLite store."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl.cli import main
from lightning_rl.records import Reward, RewardSource, RolloutStatus
from lightning_rl.store import SQLiteStore

from .store.helpers import llm_span, rollout


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "runs.db"
    with SQLiteStore(path) as s:
        s.start_rollout(rollout("r-ok"))
        s.add_spans([llm_span("r-ok", 0, 0, [1, 2], [3, 4], agent="writer"),
                     llm_span("r-ok", 1, 1, [1, 2, 3, 4, 5], [6], agent="writer")])
        s.write_reward(Reward(rollout_id="r-ok", value=1.0, source=RewardSource.RETURNED))
        s.finish_rollout("r-ok", RolloutStatus.SUCCEEDED, time.time(), None)
        s.start_rollout(rollout("r-bad"))
        s.finish_rollout("r-bad", RolloutStatus.FAILED, time.time(), "ValueError: boom")
    return str(path)


def run(*args):
    result = CliRunner().invoke(main, list(args))
    return result


def test_rollouts_ls_table_and_json(db):
    out = run("rollouts", "ls", "--store", db)
    assert out.exit_code == 0 and "r-ok" in out.output and "failed" in out.output
    rows = [json.loads(line) for line in run("rollouts", "ls", "--store", db, "--json").output.splitlines()]
    assert {r["rollout_id"]: r["status"] for r in rows} == {"r-ok": "succeeded", "r-bad": "failed"}
    failed = run("rollouts", "ls", "--store", db, "--status", "failed", "--json").output.splitlines()
    assert len(failed) == 1


def test_rollouts_show_conversation_tokens_rewards(db):
    out = run("rollouts", "show", "r-ok", "--store", db)
    assert out.exit_code == 0
    assert "[0] writer  chat tiny  2+2 tokens (engine)  reward=1.0" in out.output
    assert "user: turn 0" in out.output and "assistant: answer 1" in out.output
    assert "reward reward=1.0 (returned, rollout)" in out.output
    data = json.loads(run("rollouts", "show", "r-ok", "--store", db, "--json").output)
    assert data["final_reward"] == 1.0 and len(data["llm_calls"]) == 2


def test_export_jsonl_samples(db, tmp_path):
    out_file = tmp_path / "samples.jsonl"
    result = run("export", "--store", db, "--format", "jsonl", "--level", "trajectory", "-o", str(out_file))
    assert result.exit_code == 0
    samples = [lrl.Sample.model_validate_json(line) for line in out_file.read_text().splitlines()]
    assert len(samples) == 1  # the failed rollout is not exported
    assert samples[0].response_ids == [3, 4, 5, 6] and samples[0].response_mask == [1, 1, 0, 1]
    assert "exported 1 samples" in result.output  # summary on stderr (mixed in by CliRunner)


def test_export_tokens_as_parquet_round_trips_the_jsonl_samples(db, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    from lightning_rl.store.parquet import read_samples
    from lightning_rl.trainer_bridge.sft import sft_samples

    for level in ("call", "trajectory"):
        jsonl, parquet = tmp_path / f"{level}.jsonl", tmp_path / f"{level}.parquet"
        assert run("export", "--store", db, "--level", level, "-o", str(jsonl)).exit_code == 0
        result = run("export", "--store", db, "--level", level, "-o", str(parquet))
        assert result.exit_code == 0, result.output
        want = [lrl.Sample.model_validate_json(line) for line in jsonl.read_text().splitlines()]
        assert read_samples(parquet) == want and len(want) >= 1
        assert sft_samples(parquet, model_dir="unused") == want  # token samples need no tokenizer
    table = pq.read_table(parquet)  # what pandas, datasets or polars read: typed columns, one row per sample
    assert table.num_rows == 1 and table.schema.field("response_ids").type.value_type == "int32"
    assert table.column("response_mask").to_pylist() == [[1, 1, 0, 1]]

    result = run("export", "--store", db, "--format", "chat", "-o", str(tmp_path / "chat.parquet"))
    assert result.exit_code == 1 and "conversations are written as JSON lines" in result.output
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(lrl.ConfigurationError, match="is not a Parquet file of samples"):
        read_samples(bad)


def test_rollouts_expire_ends_what_a_killed_process_left_running(db):
    with SQLiteStore(db) as store:
        store.start_rollout(rollout("r-orphan", start_time=time.time() - 7200))
        store.start_rollout(rollout("r-fresh"))
    result = run("rollouts", "expire", "--idle", "3600", "--store", db)
    assert result.exit_code == 0 and result.output.splitlines()[0] == "r-orphan", result.output
    assert "1 running rollout(s) idle for 3600 s or more ended as timed_out" in result.output
    rows = {r["rollout_id"]: r["status"] for r in map(json.loads, run("rollouts", "ls", "--store", db, "--json")
                                                               .output.splitlines())}
    assert rows["r-orphan"] == "timed_out" and rows["r-fresh"] == "running" and rows["r-ok"] == "succeeded"
    assert run("rollouts", "expire", "--idle", "-1", "--store", db).exit_code == 1


def test_user_mistakes_exit_1_with_one_line(db, tmp_path):
    tasks, empty = tmp_path / "tasks.jsonl", tmp_path / "empty.jsonl"
    tasks.write_text('{"a": 1}\n')
    empty.write_text("\n")
    trains = ["--model-dir", str(tmp_path), "--server-url", "http://127.0.0.1:9", "--store", db]
    for args in (["rollouts", "show", "nope", "--store", db],
                 ["train", "run", "--agent", "no_colon", "--tasks", str(tasks), *trains],
                 ["train", "run", "--agent", "tests.trainer_bridge.sync_agents:counting_agent", "--tasks", str(empty),
                  *trains],
                 ["train", "run", "--agent", "tests.trainer_bridge.sync_agents:counting_agent", "--tasks", str(tasks),
                  "--steps", "0", *trains],
                 ["train", "run", "--agent", "tests.trainer_bridge.sync_agents:counting_agent", "--tasks", str(tasks),
                  "--policy", "planner", *trains],
                 ["train", "run", "--agent", "tests.trainer_bridge.sync_agents:counting_agent", "--tasks", str(tasks),
                  "--weights", "full", "--policy", "planner=policy", *trains],
                 ["train", "run", "--agent", "tests.trainer_bridge.sync_agents:counting_agent", "--tasks", str(tasks),
                  *trains],  # a model folder without config.json
                 ["train", "replay", db, "--model-dir", str(tmp_path)],  # a run with nothing to replay
                 ["train", "verl", "--agent", "no_colon"],
                 ["export", "--store", db, "--credit", "bogus"],
                 ["rollouts", "ls", "--store", "redis://x"],
                 ["gateway", "--upstream", "http://127.0.0.1:8000", "--host", "0.0.0.0"],  # no token
                 ["gateway", "--upstream", "ftp://engine", "--store", db]):
        result = run(*args)
        assert result.exit_code == 1, args
        assert result.output.startswith("Error: ") and result.output.count("\n") == 1, result.output
        assert "Traceback" not in result.output
    steps = run("train", "run", "--agent", "tests.trainer_bridge.sync_agents:counting_agent", "--tasks", str(tasks),
                "--steps", "0", *trains)
    assert "Trainer.steps must be an int >= 1, got 0 (updates)" in steps.output
    nothing = run("train", "replay", db, "--model-dir", str(tmp_path))
    assert "has no training groups to replay" in nothing.output


def _commands(group, prefix=()):
    import click

    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_every_command_has_help_with_an_example_and_is_documented():
    readme = (__import__("pathlib").Path(__file__).parent.parent / "README.md").read_text()
    for path, cmd in _commands(main):
        result = run(*path, "--help")
        assert result.exit_code == 0 and "Example:" in result.output, path
        assert f"lightning-rl {' '.join(path)}" in readme, f"`lightning-rl {' '.join(path)}` is not in README.md"


def test_plot_writes_a_png_and_rejects_empty_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(x) for x in [
        {"step": 0, "eval_success": 0.2}, {"step": 1, "train_reward": 0.3}, {"step": 2, "train_reward": 0.6},
        {"step": 2, "eval_success": 0.7}]) + "\n")
    out = tmp_path / "r.png"
    result = run("plot", str(metrics), "-o", str(out))
    assert result.exit_code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"step": 1}\n')
    bad = run("plot", str(empty))
    assert bad.exit_code == 1 and "no train_reward or eval_success" in bad.output


def _sft_db(path, tokenizer_tools):
    """Two groups of two tries, a calculator conversation each, rewarded 1 and 0."""
    from lightning_rl import semconv
    from lightning_rl.records import Span, SpanTokens

    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}
    with SQLiteStore(path) as s:
        for g in range(2):
            for attempt, reward in enumerate((0.0, 1.0)):
                rid = f"r{g}{attempt}"
                s.start_rollout(rollout(rid, group_id=f"g{g}", attempt=attempt))
                conversation = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 2+2?"},
                                {"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_1", "content": str(4 + attempt - 1)}]
                s.add_spans([Span(rollout_id=rid, seq=0, trace_id="%032x" % 1, span_id="%016x" % 2, name="chat tiny",
                                  kind="CLIENT", start_ns=1, end_ns=2, tokens=SpanTokens(prompt_ids=[1, 2], response_ids=[3]),
                                  attributes={semconv.GEN_AI_OPERATION_NAME: "chat", semconv.LLM_CALL_INDEX: 0,
                                              semconv.GEN_AI_AGENT_NAME: "calc", semconv.TOKEN_IDS_SOURCE: "engine",
                                              semconv.GEN_AI_TOOL_DEFINITIONS: json.dumps(tokenizer_tools),
                                              semconv.GEN_AI_INPUT_MESSAGES: json.dumps(conversation),
                                              semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps(
                                                  [{"role": "assistant", "content": str(4 + attempt - 1)}])})])
                s.write_reward(Reward(rollout_id=rid, value=reward, source=RewardSource.RETURNED))
                s.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)


def test_export_chat_for_sft_filters_best_of_group_and_renders_with_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from .conftest import ensure_tiny_model

    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}]
    db = str(tmp_path / "sft.db")
    _sft_db(db, tools)
    out = tmp_path / "sft.jsonl"
    result = run("export", "--store", db, "--format", "chat", "--min-reward", "1", "-o", str(out))
    assert result.exit_code == 0, result.output
    examples = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(e["rollout_id"] for e in examples) == ["r01", "r11"] and all(e["reward"] == 1.0 for e in examples)
    assert "exported 2 conversations from 4 succeeded rollouts (skipped: 2 reward out of range)" in result.output
    first = examples[0]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert first["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"expression": "2+2"}  # an object
    assert first["tools"] == tools
    # what fine-tuning tools do with it: the served model's chat template renders it, tools and all
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    text = tokenizer.apply_chat_template(first["messages"], tools=first["tools"], tokenize=False)
    assert '"expression": "2+2"' in text and "<tool_response>" in text and "calculator" in text

    best = [json.loads(x) for x in run("export", "--store", db, "--format", "chat", "--best-of-group").output
            .splitlines() if x.startswith("{")]
    assert sorted(e["rollout_id"] for e in best) == ["r01", "r11"]  # the rewarded try of each group


def test_an_export_that_matches_nothing_says_why(tmp_path):
    db = str(tmp_path / "sft.db")
    _sft_db(db, [])
    result = run("export", "--store", db, "--format", "chat", "--min-reward", "2")
    assert result.exit_code == 1
    assert "matched no conversation (4 succeeded rollouts read; skipped: 4 reward out of range)" in result.output
    assert run("export", "--store", db, "--mode", "prod").exit_code == 1
    assert run("export", "--store", db, "--min-reward", "1").exit_code == 1  # chat-only filters on tokens


@pytest.mark.parametrize("kind", ["sqlite", "http"])
def test_rollouts_show_takes_a_unique_prefix_and_names_the_candidates(db, kind, tmp_path):
    with SQLiteStore(db) as s:
        for rid in ("3f2a9c1b07de" + "0" * 20, "3f2a9c1b07de" + "1" * 20, "77aa" + "2" * 28):
            s.start_rollout(rollout(rid))
            s.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)
    if kind == "http":
        from lightning_rl.store.http.server import BackgroundServer

        server = BackgroundServer(db).__enter__()
        store = server.url
    else:
        server, store = None, db
    try:
        one = run("rollouts", "show", "77aa", "--store", store)  # listings and logs show 12 characters
        assert one.exit_code == 0 and "rollout 77aa" + "2" * 28 in one.output, one.output
        exact = run("rollouts", "show", "r-ok", "--store", store)
        assert exact.exit_code == 0 and "rollout r-ok " in exact.output
        two = run("rollouts", "show", "3f2a9c1b07de", "--store", store)
        assert two.exit_code == 1 and "Traceback" not in two.output
        assert "3f2a9c1b07de" + "0" * 20 in two.output and "3f2a9c1b07de" + "1" * 20 in two.output
        none = run("rollouts", "show", "zz", "--store", store)
        assert none.exit_code == 1 and "no rollout 'zz'" in none.output
    finally:
        if server is not None:
            server.__exit__(None, None, None)
