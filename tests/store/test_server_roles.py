"""Tokens with roles on the store server (``store/server_auth.py``): every route has a role; a runner's token
writes and leases but reads no rollout and erases nothing; a reader's writes nothing; the admin's does all;
tokens rotate without a restart. Through real servers over a SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.cli import main
from lightning_rl.errors import ConfigurationError
from lightning_rl.records import QueueStatus, Rollout, RolloutQuery, RolloutStatus
from lightning_rl.store import wait_for_groups
from lightning_rl.store.http.client import HttpStore
from lightning_rl.store.memory_store import InMemoryStore
from lightning_rl.store.http.server import OPEN_PATHS, BackgroundServer, create_app
from lightning_rl.store.http.auth import (
    RELOAD_EVERY,
    ROUTE_ROLES,
    mint_token,
    parse_tokens,
    route_table,
    token_digest,
)
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.runner import Runner

from ..services import wait_healthy
from .server_agents import add

ADMIN_TOKEN = "admin-token-for-the-tests"


# -- every route has a role ------------------------------------------------------------------------------------
def test_every_route_of_the_app_has_a_role_and_every_role_entry_a_route():
    from fastapi.routing import APIRoute

    _, app = create_app(InMemoryStore())
    served = {(m, r.path) for r in app.routes if isinstance(r, APIRoute) and r.path not in OPEN_PATHS
              for m in r.methods}
    assert served == set(ROUTE_ROLES), "every route needs an entry in server_auth.ROUTE_ROLES, and only routes"


def test_a_route_without_a_role_cannot_be_served():
    app = FastAPI()

    @app.post("/v1/rollouts/purge_everything")
    async def purge() -> dict:
        return {}

    with pytest.raises(ConfigurationError, match=r"route POST /v1/rollouts/purge_everything has no role; add it"):
        route_table(app, OPEN_PATHS)


# -- the tokens file ---------------------------------------------------------------------------------------------
def test_a_tokens_file_holds_digests_and_bad_lines_get_one_line_errors():
    runner, both = mint_token("runner"), mint_token(["reader", "runner"])
    table = parse_tokens(f"# comment\n\n{runner.line}  # a runner machine\n{both.line}\nadmin a-plain-token-of-20ch\n")
    assert table == {token_digest(runner.token): {"runner"}, token_digest(both.token): {"runner", "reader"},
                     token_digest("a-plain-token-of-20ch"): {"admin"}}
    assert runner.token not in runner.line and runner.line.startswith("runner sha256:")
    for text, says in [("runner", "line 1: 'runner' is not 'ROLES TOKEN'"),
                       ("\nwriter sha256:" + "0" * 64, "line 2: 'writer' is not a role; use runner, reader, admin"),
                       ("runner sha256:abc", "is not sha256: and 64 hex digits"),
                       ("reader short", "a token of 5 characters is too short")]:
        with pytest.raises(ConfigurationError) as refused:
            parse_tokens(text)
        assert says in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_store_token_prints_a_line_the_server_takes_and_serve_refuses_a_bad_file(tmp_path):
    out = CliRunner().invoke(main, ["store", "token", "--role", "runner", "--role", "reader", "--json"])
    assert out.exit_code == 0, out.output
    minted = json.loads(out.output)
    assert parse_tokens(minted["line"]) == {token_digest(minted["token"]): {"runner", "reader"}}
    bad_role = CliRunner().invoke(main, ["store", "token", "--role", "root"])
    assert bad_role.exit_code == 1 and "'root' is not a role" in bad_role.output
    bad = tmp_path / "tokens"
    bad.write_text("runner\n")
    refused = CliRunner().invoke(main, ["store", "serve", "--db", str(tmp_path / "x.db"), "--tokens", str(bad)])
    assert refused.exit_code == 1 and refused.output.count("\n") == 1 and "line 1" in refused.output, refused.output
    assert not (tmp_path / "x.db").exists()  # refused before the store was touched


# -- a real server over SQLite and PostgreSQL --------------------------------------------------------------------
@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path) -> str:
    return request.getfixturevalue("pg_url") if request.param == "postgres" else str(tmp_path / "roles.db")


@pytest.fixture
def minted():
    return {"runner": mint_token("runner"), "reader": mint_token("reader")}


@pytest.fixture
def served(db, tmp_path, minted):
    tokens = tmp_path / "tokens"
    tokens.write_text("# the runner machines and the viewer\n" + "".join(m.line + "\n" for m in minted.values()))
    with BackgroundServer(db, token=ADMIN_TOKEN, tokens_file=tokens) as srv:
        yield srv


@pytest.fixture
def sink():
    """Restores the tracer's sink after a test that configures its own."""
    previous = tracing._sink
    yield
    tracing.set_sink(previous)
    tracing.reset_policy_versions()


def _client(srv, token: str, tmp_path, name: str, **kwargs) -> HttpStore:
    return HttpStore(srv.url, token=token, spill_dir=tmp_path / f"spill-{name}", **kwargs)


def test_a_runner_token_records_and_leases_but_reads_no_rollout_and_erases_nothing(served, minted, tmp_path, sink):
    admin = _client(served, ADMIN_TOKEN, tmp_path, "admin")
    runner = _client(served, minted["runner"].token, tmp_path, "runner", retry_for=30)
    group = admin.enqueue({"a": 2, "b": 3}, n=2)[0].group_id
    diagnostics.reset()
    lrl.configure(store=runner)
    with Runner(runner, add, concurrency=2) as worker:  # lease, heartbeat, spans, rewards, finish, complete
        worker.run_until_done([group])
    runner.flush()
    assert diagnostics.counters().get("store_server_forbidden", 0) == 0  # nothing it needed was refused
    entries = admin.queue_entries([group])
    assert {e.status for e in entries} == {QueueStatus.DONE}
    rid = entries[0].rollout_id
    assert admin.get_rollout(rid).status == RolloutStatus.SUCCEEDED and admin.spans(rid)
    # what a runner's tracer reads, and a late reward, are allowed
    runner.add_reward(rid, 1.0, name="feedback", uid="fb-1")
    assert [r.name for r in admin.rewards(rid)] == ["reward", "feedback"]
    assert runner.latest_policies() == {} and runner.latest_decisions() == {}
    assert {e.queue_id for e in runner.queue_entries([group])} == {e.queue_id for e in entries}
    with pytest.raises(lrl.RolloutNotFoundError):
        runner.add_reward("ghost", 1.0)
    # what it may not do: 403 at once (not retried for retry_for), naming the role needed
    (spare,) = admin.enqueue({"a": 1, "b": 1}, n=1)  # a queued try only the trainer may cancel
    refused = {
        "spans": lambda: runner.spans(rid), "rewards": lambda: runner.rewards(rid),
        "rollout": lambda: runner.get_rollout(rid), "rollouts": lambda: runner.rollouts(),
        "page": lambda: runner.rollout_page(RolloutQuery()), "data": lambda: list(runner.rollout_data([rid])),
        "erase": lambda: runner.delete_rollouts([rid]), "enqueue": lambda: runner.enqueue({"a": 1, "b": 1}),
        "publish": lambda: runner.record_policy("policy", 7, adapter="/tmp/v7"),
        "decide": lambda: runner.record_decision("policy", 7, "rolled_back", live_version=8),
        "quarantine": lambda: runner.quarantined(), "rewarded": lambda: runner.rewarded_since(0),
        "whole queue": lambda: runner.queue_entries(),  # only the groups it names
        "cancel": lambda: runner.cancel([spare.queue_id]),  # the trainer's, as enqueueing is
    }
    t0 = time.monotonic()
    for what, call in refused.items():
        with pytest.raises(ConfigurationError) as no:
            call()
        text = str(no.value)
        assert "HTTP 403" in text and "this token is a runner token" in text and "\n" not in text, (what, text)
        needed = "an admin token" if what in ("erase", "enqueue", "cancel", "publish", "decide") else "a reader token"
        assert f"needs {needed}" in text, (what, text)
    assert time.monotonic() - t0 < 10  # fourteen refusals, none waited out retry_for=30
    raw = httpx.get(f"{served.url}/v1/rollouts/{rid}/spans",
                    headers={"authorization": f"Bearer {minted['runner'].token}"})
    assert raw.status_code == 403 and raw.json()["error"].startswith(f"GET /v1/rollouts/{rid}/spans needs a reader")
    # nothing a refusal touched changed: the rollout is there, no publish, no decision, no new try
    assert admin.get_rollout(rid) and admin.policies() == [] and admin.decisions() == []
    assert len(admin.queue_entries()) == 3 and admin.queue_entries([spare.group_id])[0].status == QueueStatus.QUEUED
    # the admin may do all of it
    assert admin.cancel([spare.queue_id], reason="by hand") == [spare.queue_id]
    assert admin.queue_entries([spare.group_id])[0].status == QueueStatus.CANCELLED
    admin.record_policy("policy", 7, adapter="/tmp/v7")
    admin.record_decision("policy", 7, "rolled_back", live_version=8)
    assert runner.latest_policies()["policy"].version == 7 and runner.latest_decisions()["policy"].version == 7
    assert admin.delete_rollouts([rid]) == 1
    with pytest.raises(lrl.RolloutNotFoundError):
        admin.get_rollout(rid)
    for client in (runner, admin):
        client.close()


def test_a_reader_token_reads_everything_and_writes_nothing(served, minted, tmp_path, sink):
    admin = _client(served, ADMIN_TOKEN, tmp_path, "admin")
    lrl.configure(store=admin)
    add({"a": 1, "b": 2})
    admin.flush()
    (rid,) = [r.rollout_id for r in admin.rollouts()]
    reader = _client(served, minted["reader"].token, tmp_path, "reader", retry_for=30)
    assert reader.get_rollout(rid).status == RolloutStatus.SUCCEEDED and len(reader.spans(rid)) == 2
    assert reader.rollout_page(RolloutQuery()).total == 1 and list(reader.rollout_data([rid]))
    assert len(list(lrl.trajectories(reader))) == 1 and reader.rewarded_since(0)[0] == [rid]
    for call in (lambda: reader.lease("r-1"), lambda: reader.add_reward(rid, 1.0),
                 lambda: reader.delete_rollouts([rid]), lambda: reader.record_policy("policy", 1),
                 lambda: reader.cancel(["a-queue-id"])):
        with pytest.raises(ConfigurationError, match="HTTP 403.*this token is a reader token"):
            call()
    # a reader's tracer: the batch is refused (403), set aside with the reason, never retried for ever
    lrl.configure(store=reader)
    add({"a": 5, "b": 5})
    assert reader.flush(10)
    kept = reader.rejected_files
    assert kept and all("POST /v1/batch needs a runner token" in f.read_text() for f in kept)
    assert [r.rollout_id for r in admin.rollouts()] == [rid]
    reader.close()
    admin.close()


def test_no_token_or_an_unknown_one_is_401_and_the_admin_token_works_as_before(served, minted):
    url = f"{served.url}/v1/rollouts"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"authorization": f"Bearer {minted['runner'].line.split()[1]}"})  # the digest
    assert wrong.status_code == 401 and "wrong bearer token" in wrong.json()["error"]
    assert httpx.get(url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
    assert httpx.get(f"{served.url}/v1/nothing-here", headers={"authorization": f"Bearer {minted['runner'].token}"}
                     ).status_code == 404  # an unknown route: any known token gets the app's 404
    assert httpx.get(f"{served.url}/v1/nothing-here").status_code == 401


# -- rotation without a restart, through `lightning-rl store serve` and `lightning-rl runner` ------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _statuses(url: str, token: str, n: int = 12) -> set[int]:
    """What ``n`` requests with ``token`` get (two workers: each answers some of them)."""
    with httpx.Client(headers={"authorization": f"Bearer {token}"}) as http:
        return {http.get(f"{url}/v1/policies").status_code for _ in range(n)}


def _replace(path, text: str) -> None:
    new = path.with_suffix(".new")
    new.write_text(text)
    os.replace(new, path)  # what an operator's tool does: the file is never half written


def test_a_runner_process_on_a_runner_token_and_tokens_rotated_without_a_restart(db, tmp_path):
    old, new = mint_token("runner"), mint_token("runner")
    tokens = tmp_path / "tokens"
    tokens.write_text(old.line + "\n")
    port = _free_port()
    env = dict(os.environ, LIGHTNING_RL_SPILL_DIR=str(tmp_path / "spill"))
    env.pop("LIGHTNING_RL_STORE_TOKEN", None)
    server = subprocess.Popen([sys.executable, "-m", "lightning_rl.cli", "store", "serve", "--db", db, "--port",
                               str(port), "--workers", "2", "--tokens", str(tokens)],
                              env=dict(env, LIGHTNING_RL_STORE_TOKEN=ADMIN_TOKEN), stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, what="the store server")
        admin = HttpStore(url, token=ADMIN_TOKEN, spill_dir=tmp_path / "spill-admin")
        group = admin.enqueue({"a": 2, "b": 3}, n=3)[0].group_id
        ran = subprocess.run(
            [sys.executable, "-m", "lightning_rl.cli", "runner", "--agent", "tests.store.server_agents:add",
             "--store", url, "--concurrency", "2", "--max-rollouts", "3", "--report", str(tmp_path / "report.json")],
            env=dict(env, LIGHTNING_RL_STORE_TOKEN=old.token), capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        assert wait_for_groups(admin, [group], timeout=10)
        counters = json.loads((tmp_path / "report.json").read_text())["counters"]
        assert not [k for k in counters if k.startswith("runner ") or k == "rejected_ops"], counters
        assert {r.status for r in admin.rollouts()} == {RolloutStatus.SUCCEEDED} and len(admin.rollouts()) == 3

        assert _statuses(url, old.token) == {200} and _statuses(url, new.token) == {401}
        _replace(tokens, new.line + "\n")  # rotate: the new token in, the old one out
        time.sleep(RELOAD_EVERY + 0.5)  # the bound: each worker looks at the file at most RELOAD_EVERY apart
        assert _statuses(url, old.token) == {401} and _statuses(url, new.token) == {200}
        _replace(tokens, new.line.replace("runner ", "reader ", 1) + "\n")  # a role changed
        time.sleep(RELOAD_EVERY + 0.5)
        lease = httpx.post(f"{url}/v1/queue/lease", json={"runner": "r", "key": "k"},
                           headers={"authorization": f"Bearer {new.token}"})
        assert lease.status_code == 403 and "needs a runner token" in lease.json()["error"]
        _replace(tokens, "runner " + new.token[:8] + "\n")  # a broken file: its tokens are refused (fail closed)
        time.sleep(RELOAD_EVERY + 0.5)
        assert _statuses(url, new.token) == {401} and _statuses(url, ADMIN_TOKEN) == {200}
        _replace(tokens, new.line + "\n")  # fixed
        time.sleep(RELOAD_EVERY + 0.5)
        assert _statuses(url, new.token) == {200}
        assert server.poll() is None  # never restarted
        admin.close()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:  # never leave a server behind (nor hide the test's own failure)
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(30)


# -- which command needs which role (docs/fleet.md, "Tokens and roles") ----------------------------------------------
def test_the_commands_work_with_the_role_the_docs_name_and_say_which_role_otherwise(tmp_path, minted, sink):
    tokens = tmp_path / "tokens"
    both = mint_token("runner,reader")
    tokens.write_text("".join(m.line + "\n" for m in (*minted.values(), both)))
    with BackgroundServer(tmp_path / "cli.db", token=ADMIN_TOKEN, tokens_file=tokens) as srv:
        admin = HttpStore(srv.url, token=ADMIN_TOKEN, spill_dir=tmp_path / "spill-admin")
        lrl.configure(store=admin)
        add({"a": 1, "b": 1})
        admin.flush()
        (rid,) = [r.rollout_id for r in admin.rollouts()]

        def run(token: str, *args: str):
            return CliRunner().invoke(main, list(args), env={"LIGHTNING_RL_STORE_TOKEN": token,
                                                             "LIGHTNING_RL_SPILL_DIR": str(tmp_path / "spill-cli")})

        store = ("--store", srv.url)
        reads = [("rollouts", "ls", *store), ("rollouts", "show", rid[:12], *store),
                 ("export", "--format", "chat", *store, "-o", str(tmp_path / "chat.jsonl")),
                 ("store", "doctor", *store),
                 ("store", "prune", "--older-than", "0s", "--dry-run", *store)]
        for args in reads:
            ok = run(minted["reader"].token, *args)
            read = ok.exit_code == 0 or "the export matched no conversation" in ok.output  # (the agent calls no LLM)
            # a refusal says HTTP 403 and the role it needs (the server's port or a rollout id may hold "403")
            assert read and not re.search(r"\b403\b|needs an? \w+ token", ok.output), (args, ok.output)
            refused = run(minted["runner"].token, *args)
            assert refused.exit_code == 1 and refused.output.count("\n") == 1, (args, refused.output)
            assert "needs a reader token" in refused.output and "this token is a runner token" in refused.output
        erase = run(minted["reader"].token, "store", "prune", "--older-than", "0s", *store)
        assert erase.exit_code == 1 and "POST /v1/rollouts/delete needs an admin token" in erase.output
        admin.start_rollout(Rollout(rollout_id="stuck", start_time=time.time() - 60))  # its process was killed
        admin.flush()
        expire = ("rollouts", "expire", "--idle", "1", *store)  # reads running rollouts, writes their end
        run(minted["reader"].token, *expire)  # its write is refused (403): kept aside with the reason, logged once
        assert admin.get_rollout("stuck").status == RolloutStatus.RUNNING
        assert any("needs a runner token" in f.read_text() for f in (tmp_path / "spill-cli").glob("rejected-*"))
        assert run(both.token, *expire).exit_code == 0
        assert admin.get_rollout("stuck").status == RolloutStatus.TIMED_OUT
        assert run(ADMIN_TOKEN, "store", "prune", "--older-than", "0s", *store).exit_code == 0
        assert admin.rollouts() == []
        admin.close()


def test_a_runner_whose_token_may_not_lease_stops_at_once_with_the_403(served, minted, tmp_path, sink):
    """A 403 is a setting to fix, not an outage: the runner does not retry it every second for ever."""
    admin = _client(served, ADMIN_TOKEN, tmp_path, "admin")
    admin.enqueue({"a": 2, "b": 3}, n=1)
    reader = _client(served, minted["reader"].token, tmp_path, "reader", retry_for=30)
    started = time.monotonic()
    with Runner(reader, add, concurrency=1, wait=1.0) as worker:
        with pytest.raises(ConfigurationError, match="HTTP 403.*reader token"):
            worker.serve(idle_exit=20)
    assert time.monotonic() - started < 10
    assert [e.status for e in admin.queue_entries()] == ["queued"]  # the try is still there for a runner that may


def test_a_shared_gateway_whose_store_token_cannot_read_stops_at_start(served, minted, tmp_path):
    """--shared reads every rollout back: a runner-only token is refused before serving, not on every call."""
    env = {**os.environ, "LIGHTNING_RL_STORE_TOKEN": minted["runner"].token}
    result = subprocess.run([sys.executable, "-m", "lightning_rl.cli", "gateway", "--shared", "--token", "g" * 32,
                             "--store", served.url, "--upstream", "http://127.0.0.1:9", "--port", str(_free_port())],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "HTTP 403" in result.stderr and "reader" in result.stderr and "Traceback" not in result.stderr


def test_a_command_agent_in_a_runner_with_a_runner_token_asks_the_store_for_nothing_it_may_not(
        served, minted, tmp_path, sink):
    """``lrl.command`` runs an in-process gateway; its rollouts are the traced function's own. It swept the
    store for orphaned gateway rollouts (a read a runner token may not make): 403 at its start and every
    minute, counted and logged in every runner process. The in-process gateway sweeps nothing."""
    runner = _client(served, minted["runner"].token, tmp_path, "runner", retry_for=30)
    diagnostics.reset()
    lrl.configure(store=runner)
    import asyncio

    agent = lrl.command(["sh", "-c", "cat >/dev/null; echo 1"], upstream="http://127.0.0.1:7")  # its own gateway
    assert asyncio.run(agent({"a": 1})) == 1.0
    runner.flush()
    time.sleep(1.0)  # a sweep runs at once when a gateway starts
    assert diagnostics.counters().get("store_server_forbidden", 0) == 0
    assert not any("sweep" in name for name in diagnostics.counters())
