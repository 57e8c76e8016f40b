"""``lightning-rl view`` and ``export`` over a PostgreSQL store, run as a user runs them: the viewer's list,
a rollout page and a group page; token samples and chat conversations, the same as from SQLite."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import orjson
from click.testing import CliRunner

from lightning_rl import semconv
from lightning_rl.cli import main
from lightning_rl.records import Reward, RewardSource, Rollout, RolloutStatus
from lightning_rl.store.postgres.store import PostgresStore
from lightning_rl.store.sqlite.store import SQLiteStore

from ..services import wait_healthy
from .helpers import llm_span

PROMPT = list(range(100, 120))


def _fill(store) -> None:
    """A group of four tries (rewards 1, 0, 1, 0), each two LLM calls (the second prompt extends the first
    call), and a failed rollout; as the tracer would record them."""
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        rid = f"try{i}"
        store.start_rollout(Rollout(rollout_id=rid, name="solver", agent="solver", task={"q": "2+2"}, group_id="g-sum",
                                    attempt=i, start_time=1_700_000_000.0 + i))
        first = llm_span(rid, 0, 0, PROMPT, [4, 5 + i])
        second = llm_span(rid, 1, 1, [*PROMPT, 4, 5 + i, 9], [7, 8])
        second.attributes[semconv.GEN_AI_INPUT_MESSAGES] = orjson.dumps(
            [{"role": "user", "content": "turn 0"}, {"role": "assistant", "content": "answer 0"},
             {"role": "user", "content": "turn 1"}]).decode()
        store.add_spans([first, second])
        store.write_reward(Reward(rollout_id=rid, value=reward, source=RewardSource.RETURNED, time=1_700_000_001.0 + i))
        store.finish_rollout(rid, RolloutStatus.SUCCEEDED, 1_700_000_001.0 + i, None)
    store.start_rollout(Rollout(rollout_id="broken", name="solver", task={"q": "?"}, start_time=1_700_000_010.0))
    store.finish_rollout("broken", RolloutStatus.FAILED, 1_700_000_011.0, "ValueError: gave up")
    assert store.flush(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_view_over_postgresql_lists_rollouts_and_shows_a_rollout_and_a_group(pg_url, tmp_path):
    with PostgresStore(pg_url) as store:
        _fill(store)
    port = _free_port()
    viewer = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "view", "--store", pg_url, "--port", str(port)],
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path)))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, viewer, what="the viewer", path="/health")
        # generous timeouts: the group page's first request imports torch (the advantage estimator), slow on a
        # busy machine
        http = httpx.Client(base_url=url, timeout=60)
        listing = http.get("/").text
        assert listing.count("data-rollout=") == 5 and "broken" in listing
        failed = http.get("/", params={"status": "failed"}).text
        assert failed.count("data-rollout=") == 1
        page = http.get("/rollouts/try0")
        assert page.status_code == 200 and "answer 0" in page.text and "turn 1" in page.text
        assert "prompt (23 tokens; the first 22 are call 0" in page.text  # the shared prefix, read back from PostgreSQL
        group = http.get("/groups/g-sum").text
        # GRPO over rewards 1, 0, 1, 0: mean 0.5, std 0.577 (unbiased) -> +-0.866
        assert group.count("class='num advantage'>0.866<") == 2 and group.count("class='num advantage'>-0.866<") == 2
        assert http.get("/rollouts/nope").status_code == 404
        http.close()
    finally:
        viewer.terminate()
        viewer.wait(30)
    with PostgresStore(pg_url, read_only=True) as store:  # the viewer wrote nothing
        assert len(store.rollouts()) == 5 and store.quarantined() == []


def test_export_from_postgresql_is_what_sqlite_exports(pg_url, tmp_path):
    with PostgresStore(pg_url) as store:
        _fill(store)
    with SQLiteStore(tmp_path / "same.db") as store:
        _fill(store)
    runner = CliRunner()
    for args in (["--format", "tokens"], ["--format", "tokens", "--level", "trajectory"], ["--format", "chat"],
                 ["--format", "chat", "--min-reward", "1", "--best-of-group"]):
        outs = []
        for where, name in ((pg_url, "pg"), (str(tmp_path / "same.db"), "sqlite")):
            out = tmp_path / f"{name}-{'-'.join(a.strip('-') for a in args)}.jsonl"
            done = runner.invoke(main, ["export", "--store", where, *args, "-o", str(out)])
            assert done.exit_code == 0, done.output
            outs.append(out.read_text())
        pg, sqlite = outs
        lines = [orjson.loads(line) for line in pg.splitlines()]
        assert pg == sqlite and lines, args
    tokens = [orjson.loads(line) for line in (tmp_path / "pg-format-tokens-level-trajectory.jsonl").read_text().splitlines()]
    assert len(tokens) == 4 and tokens[0]["prompt_ids"] == PROMPT  # one sample per trajectory, the failed one out
    assert tokens[0]["response_ids"] == [4, 5, 9, 7, 8] and tokens[0]["response_mask"] == [1, 1, 0, 1, 1]
    chats = [orjson.loads(line) for line in (tmp_path / "pg-format-chat.jsonl").read_text().splitlines()]
    assert len(chats) == 4 and [m["role"] for m in chats[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    best = (tmp_path / "pg-format-chat-min-reward-1-best-of-group.jsonl").read_text().splitlines()
    assert len(best) == 1 and orjson.loads(best[0])["reward"] == 1.0
