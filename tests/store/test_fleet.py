"""Store servers over one PostgreSQL database, and clients given several of them.

Every server is a real uvicorn server on a loopback port over a database of the session's real
PostgreSQL server (``pg_url``: a fresh database per test)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.errors import ConfigurationError
from lightning_rl.records import Reward, RolloutStatus
from lightning_rl.serving import ServerThread
from lightning_rl.store.http.client import HttpStore
from lightning_rl.store.postgres.store import PostgresStore
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.store.uri import open_store, same_store

from .helpers import llm_span, rollout


def _write_rollout(store, rid: str, spans: int = 3) -> None:
    store.start_rollout(rollout(rid))
    store.add_spans([llm_span(rid, seq, seq, [1, 2, 3], [4, 5]) for seq in range(spans)])
    store.write_reward(Reward(rollout_id=rid, value=1.0))
    store.finish_rollout(rid, RolloutStatus.SUCCEEDED, time.time(), None)


def _counts(pg_url: str) -> dict[str, tuple[int, int, str]]:
    """Per rollout, straight from the database: (spans, rewards, status)."""
    with PostgresStore(pg_url, read_only=True) as db:
        return {r.rollout_id: (len(db.spans(r.rollout_id)), len(db.rewards(r.rollout_id)), r.status.value)
                for r in db.rollouts()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoUpstream:
    """What a load balancer answers when the server behind it is gone: 502 to everything."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 502, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"no healthy upstream"})


def test_a_server_over_postgresql_is_the_store(pg_url, tmp_path):
    secret_url = pg_url.replace("://postgres@", "://postgres:hunter2@")  # trust auth ignores it; messages must too
    with BackgroundServer(secret_url) as server:
        health = httpx.get(f"{server.url}/v1/health").json()
        assert health["ok"] and health["store"].startswith("postgresql://") and "hunter2" not in health["store"]
        client = HttpStore(server.url, spill_dir=tmp_path / "spill", retry_for=5)
        _write_rollout(client, "r1")
        assert client.flush(10)
        client.add_reward("r1", 0.5, name="user_feedback", uid="fb-1")
        client.add_reward("r1", 0.5, name="user_feedback", uid="fb-1")  # a retried call: stored once
        (entry,) = client.enqueue({"q": 1}, n=1)
        (leased,) = client.lease("runner-a", lease_seconds=60)
        assert leased.queue_id == entry.queue_id and client.complete(leased.queue_id, "runner-a", "succeeded")
        assert lrl.trajectory(client, "r1").final_reward == 1.0
        client.close()
    assert _counts(pg_url) == {"r1": (3, 2, "succeeded")}


def test_two_servers_over_one_database_are_one_store(pg_url, tmp_path):
    with BackgroundServer(pg_url) as one, BackgroundServer(pg_url) as two:
        a = HttpStore(one.url, spill_dir=tmp_path / "spill-a", retry_for=5)
        b = HttpStore(two.url, spill_dir=tmp_path / "spill-b", retry_for=5)
        _write_rollout(a, "written-through-one")
        a.flush(10)
        assert [s.seq for s in b.spans("written-through-one")] == [0, 1, 2]  # read through the other server
        b.add_spans([llm_span("written-through-one", 3, 3, [1], [2])])  # a rollout the other server started:
        assert b.flush(10) and b.spill_files == []  # this one finds it in the database
        groups = [a.enqueue({"q": i}, n=2)[0].group_id for i in range(5)]
        leased = []
        for _ in range(6):  # the two servers' leases alternate; none is handed out twice
            leased += a.lease("runner-a", limit=1) + b.lease("runner-b", limit=1)
        assert len(leased) == 10 and len({e.queue_id for e in leased}) == 10
        assert {e.group_id for e in leased} == set(groups)
        a.close()
        b.close()
    assert _counts(pg_url)["written-through-one"] == (4, 1, "succeeded")


def _lose_answers(client: HttpStore, path: str) -> list[int]:
    """The first server does the work of the next request to ``path`` and then dies before answering (its
    connection breaks after the commit). Returns the statuses of the answers lost."""
    connection = client._servers._clients[0]
    real_send, lost = connection.send, []

    def send(request, **kwargs):
        response = real_send(request, **kwargs)
        if request.url.path.endswith(path) and not lost:
            response.read()
            lost.append(response.status_code)
            raise httpx.ReadError("connection closed before the answer", request=request)
        return response

    connection.send = send
    return lost


def test_a_retry_on_another_server_repeats_nothing(pg_url, tmp_path):
    """A server that did the work and died before answering: the client asks the next server the same
    thing, and the database's idempotence keeps it once (a lease by its key, a completion by its runner
    and outcome, an enqueue by its group id, a reward by its uid, a batch by its records' keys)."""
    with BackgroundServer(pg_url) as one, BackgroundServer(pg_url) as two:
        client = HttpStore([one.url, two.url], spill_dir=tmp_path / "spill", retry_for=5)
        lost = _lose_answers(client, "/queue/enqueue")
        entries = client.enqueue({"q": 1}, n=3)
        assert lost == [200] and client.servers == [two.url, one.url]  # moved on, and stays there
        client._servers._current = 0  # back to the first server for the next lost answer
        lost = _lose_answers(client, "/queue/lease")
        leased = client.lease("runner-a", lease_seconds=600, limit=2)
        assert lost == [200] and len(leased) == 2  # the entries the lost answer held, not two more
        rest = client.lease("runner-a", lease_seconds=600, limit=5)
        assert len(rest) == 1 and not {e.queue_id for e in leased} & {e.queue_id for e in rest}
        client._servers._current = 0
        lost = _lose_answers(client, "/queue/complete")
        assert client.complete(leased[0].queue_id, "runner-a", "succeeded") and lost == [200]
        client._servers._current = 0
        lost = _lose_answers(client, "/batch")
        _write_rollout(client, "r1")
        assert client.flush(10) and lost == [200] and client.spill_files == []
        client._servers._current = 0
        lost = _lose_answers(client, "/rewards")
        client.add_reward("r1", -1.0, name="user_feedback")
        assert lost == [200]
        client.close()
    with PostgresStore(pg_url, read_only=True) as db:
        stored = db.queue_entries([entries[0].group_id])
        assert len(stored) == 3 and sorted(e.tries for e in stored) == [1, 1, 1]  # the retried lease was no new try
        assert [e.outcome for e in stored if e.queue_id == leased[0].queue_id] == [RolloutStatus.SUCCEEDED]
        assert len(db.spans("r1")) == 3 and sorted(r.name for r in db.rewards("r1")) == ["reward", "user_feedback"]


def test_a_client_moves_to_the_next_server_when_its_server_dies(pg_url, tmp_path):
    diagnostics.reset()
    two = BackgroundServer(pg_url).__enter__()
    with BackgroundServer(pg_url) as one:
        client = HttpStore(f"{one.url},{two.url}", spill_dir=tmp_path / "spill", retry_for=5)
        _write_rollout(client, "before")
        assert client.flush(10)
    # the first server is gone: writes, queries and the queue go to the second, nothing spills
    _write_rollout(client, "after")
    assert client.flush(10) and client.spill_files == []
    assert {r.rollout_id for r in client.rollouts()} == {"before", "after"}
    (entry,) = client.enqueue({"q": 1})
    assert [e.queue_id for e in client.lease("runner-a")] == [entry.queue_id]
    assert client.servers == [two.url, one.url]
    assert diagnostics.counters()["store_server_failovers"] == 1  # one move, then it stayed
    client.close()
    two.__exit__(None, None, None)
    assert _counts(pg_url) == {"before": (3, 1, "succeeded"), "after": (3, 1, "succeeded")}


def test_a_server_answering_5xx_is_passed_over(pg_url, tmp_path):
    balancer = ServerThread(_NoUpstream())
    balancer.start("a load balancer with no upstream")
    try:
        with BackgroundServer(pg_url) as server:
            client = HttpStore([balancer.url, server.url], spill_dir=tmp_path / "spill", retry_for=5)
            _write_rollout(client, "r1")
            assert client.flush(10) and client.spill_files == []
            assert client.get_rollout("r1").status == RolloutStatus.SUCCEEDED
            client.close()
    finally:
        balancer.stop()


def test_a_url_that_is_not_a_store_server_is_passed_over_and_named(tmp_path):
    """A user trial: the viewer's port first in the list gave `Error: ` on reads (any 404 read as 'no such
    rollout') and sent every write to rejected-* files, never trying the second, good URL."""
    from lightning_rl.viewer import BackgroundViewer

    with BackgroundViewer(lrl.InMemoryStore()) as viewer, BackgroundServer(tmp_path / "s.db") as server:
        client = HttpStore([viewer.url, server.url], spill_dir=tmp_path / "spill", retry_for=5)
        _write_rollout(client, "r1")
        assert client.flush(10) and client.spill_files == [] and client.rejected_files == []
        assert client.get_rollout("r1").status == RolloutStatus.SUCCEEDED and client.servers[0] == server.url
        client.close()
        alone = HttpStore(viewer.url, spill_dir=tmp_path / "spill2", retry_for=5)
        t0 = time.monotonic()
        with pytest.raises(ConfigurationError, match=f"{viewer.url} is not a lightning-rl store server.*store serve"):
            alone.rollouts()
        assert time.monotonic() - t0 < 2  # said at once: waiting does not make it a store server
        alone.start_rollout(rollout("kept"))
        assert alone.flush(10) and alone.spill_files and alone.rejected_files == []  # kept for a right URL
        alone.close()


def test_when_no_server_answers_the_client_spills_then_replays_to_whichever_returns(pg_url, tmp_path):
    one, two = _free_port(), _free_port()  # nothing listens there (yet)
    client = HttpStore([f"http://127.0.0.1:{one}", f"http://127.0.0.1:{two}"], spill_dir=tmp_path / "spill",
                       retry_for=5)
    t0 = time.monotonic()
    _write_rollout(client, "r1")
    assert client.flush(10)
    assert time.monotonic() - t0 < 5 and client.spill_files  # refused at once by both: spilled
    with BackgroundServer(pg_url, port=two) as back:  # the second server comes back
        deadline = time.monotonic() + 15
        while client.spill_files and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.spill_files == [] and client.servers[0] == back.url
        _write_rollout(client, "r2")
        assert client.flush(10)
        client.close()
    assert _counts(pg_url) == {"r1": (3, 1, "succeeded"), "r2": (3, 1, "succeeded")}


def test_several_urls_are_one_store_setting(tmp_path, monkeypatch):
    with pytest.raises(ConfigurationError, match="ftp://b:1"):
        HttpStore("http://a:1,ftp://b:1")
    with pytest.raises(ConfigurationError, match="no store server URL"):
        HttpStore([])
    monkeypatch.setenv("LIGHTNING_RL_SPILL_DIR", str(tmp_path / "spill"))
    store = open_store("http://127.0.0.1:9/, http://127.0.0.1:10,http://127.0.0.1:9")
    assert isinstance(store, HttpStore) and store.servers == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    assert store.url == "http://127.0.0.1:9,http://127.0.0.1:10"
    store.close()
    assert same_store("http://a:1,http://b:2", "http://b:2/,http://a:1")
    assert not same_store("http://a:1,http://b:2", "http://a:1")
    monkeypatch.setenv("LIGHTNING_RL_STORE", "http://127.0.0.1:9,http://127.0.0.1:10")
    from_env = open_store()
    assert from_env.servers == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    from_env.close()


def test_the_default_spill_folder_is_one_per_set_of_servers(monkeypatch):
    from lightning_rl.store.http.client import _default_spill_dir

    monkeypatch.delenv("LIGHTNING_RL_SPILL_DIR", raising=False)
    assert _default_spill_dir(["http://a:1"]).name == "a_1"
    assert _default_spill_dir(["http://b:2", "http://a:1"]) == _default_spill_dir(["http://a:1", "http://b:2"])
    assert _default_spill_dir(["http://b:2", "http://a:1"]).name == "a_1+b_2"
    many = [f"http://store-server-{i}.example.internal:8765" for i in range(8)]
    assert len(_default_spill_dir(many).name) < 40


def test_an_unreachable_database_is_never_the_records_fault(pg_url):
    """The writer reconnects after the database went away; that connection failing (StoreError) must be
    retried and spilled like any outage, never split down to single records and quarantined (a record
    would be set aside if the database came back between its write and its quarantine)."""
    from lightning_rl.errors import StoreError
    from lightning_rl.store.postgres.store import is_record_error

    port = _free_port()
    with pytest.raises(StoreError) as refused:
        PostgresStore(f"postgresql://postgres@127.0.0.1:{port}/nothing")
    assert "cannot connect" in str(refused.value)
    assert is_record_error(refused.value) is False


def test_the_grants_of_docs_fleet_md_are_enough_for_a_server_and_a_viewer(pg_url, tmp_path, monkeypatch):
    """docs/fleet.md's roles: an administrator migrates; an app role with those grants serves the store
    (writes, the queue, late rewards, publishes); a read-only role with SELECT views it."""
    import uuid

    import psycopg

    from lightning_rl.store.postgres.store import parse_url

    monkeypatch.setenv("LIGHTNING_RL_SPILL_DIR", str(tmp_path / "spill"))
    suffix = uuid.uuid4().hex[:8]
    app, view = f"lrl_app_{suffix}", f"lrl_view_{suffix}"
    PostgresStore(pg_url).close()  # the administrator's migrate
    with psycopg.connect(parse_url(pg_url)[0], autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {app} LOGIN")
        conn.execute(f"CREATE ROLE {view} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA lightning_rl TO {app}, {view}")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA lightning_rl TO {app}")
        conn.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA lightning_rl TO {app}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA lightning_rl TO {view}")
    user = pg_url.split("://", 1)[1].split("@", 1)[0]
    try:
        with BackgroundServer(pg_url.replace(f"://{user}@", f"://{app}@")) as server:
            client = HttpStore(server.url, spill_dir=tmp_path / "spill-client", retry_for=5)
            _write_rollout(client, "r1")
            assert client.flush(10) and client.spill_files == []
            client.add_reward("r1", 0.5, name="user_feedback")
            client.record_policy("policy", 1)
            client.enqueue({"q": 1})
            (leased,) = client.lease("runner-a")
            assert client.complete(leased.queue_id, "runner-a", "succeeded")
            client.close()
            assert server.store.spill_files == [] and server.store.quarantined() == []
        with PostgresStore(pg_url.replace(f"://{user}@", f"://{view}@"), read_only=True) as viewer:
            assert viewer.rollout_page().total == 1 and len(viewer.rewards("r1")) == 2
            assert [p.version for p in viewer.policies()] == [1] and viewer.quarantined() == []
    finally:  # roles belong to the whole cluster: leave none behind
        with psycopg.connect(parse_url(pg_url)[0], autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {app}, {view}")
            conn.execute(f"DROP ROLE {app}, {view}")
    assert _counts(pg_url) == {"r1": (3, 2, "succeeded")}
