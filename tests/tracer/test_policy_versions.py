"""Which policy served a call: every process stamps LLM calls from the publishes recorded in the
store, and a rollout's version is the oldest of its calls' (real HTTP provider, real SQLite files)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import openai
import pytest

import lightning_rl as lrl
from lightning_rl.tracer import tracing

from ..adapters.strict_provider import StrictProvider
from ..conftest import ROOT


@pytest.fixture
def provider():
    from lightning_rl import capture

    with StrictProvider() as p:
        yield p
    capture.takes_token_fields.clear()


def _call_versions(store, rollout_id):
    return [c.policy_version for c in lrl.trajectory(store, rollout_id).llm_calls]


def test_a_rollout_is_as_old_as_its_oldest_call(traced, provider):
    client = openai.OpenAI(base_url=provider.base_url, api_key="k")

    @lrl.trace
    def agent(q):
        tracing.set_policy_version(2, model="policy")
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}])
        tracing.set_policy_version(3, model="policy")  # a publish lands mid-rollout
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}])
        return 1.0

    agent("q")
    lrl.flush()
    (r,) = traced.rollouts()
    assert _call_versions(traced, r.rollout_id) == [2, 3]
    assert r.policy_version == 2
    assert [t.rollout_id for t in lrl.trajectories(traced, min_policy_version=2)] == [r.rollout_id]
    assert list(lrl.trajectories(traced, min_policy_version=3)) == []


def test_another_process_stamps_the_versions_the_trainer_published(tmp_path, provider):
    db = tmp_path / "runs.db"
    with lrl.open_store(f"sqlite:///{db}") as store:
        store.record_policy("policy", 0)
        store.record_policy("policy", 4, adapter="/adapters/v00004")  # the trainer's publish
    agent = textwrap.dedent(f"""
        import openai, lightning_rl as lrl
        client = openai.OpenAI(base_url={provider.base_url!r}, api_key="k")

        @lrl.trace
        def agent(q):
            client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": q}}])
            client.chat.completions.create(model="base", messages=[{{"role": "user", "content": q}}])
            return 1.0

        agent("q")
        lrl.flush()
    """)
    env = {**os.environ, "LIGHTNING_RL_STORE": f"sqlite:///{db}", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", agent], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    with lrl.open_store(f"sqlite:///{db}") as store:
        (r,) = store.rollouts()
        # "base" was never published: the process default (0); the rollout is as old as that call
        assert _call_versions(store, r.rollout_id) == [4, 0]
        assert r.policy_version == 0


def test_a_later_publish_in_the_store_wins_over_an_older_local_version(traced):
    tracing.set_policy_version(1, model="policy")
    time.sleep(0.01)
    traced.record_policy("policy", 2)  # another trainer process published since
    tracing.settings.policy_refresh, refresh = 0.0, tracing.settings.policy_refresh
    try:
        deadline = time.time() + 5
        while tracing.policy_version("policy") != 2 and time.time() < deadline:
            time.sleep(0.02)
        assert tracing.policy_version("policy") == 2
        assert tracing.policy_version() == 2  # one served name known: it is the default
        tracing.set_policy_version(3, model="policy")  # this process's own publish, newer than the store's
        assert tracing.policy_version("policy") == 3
        traced.record_policy("critic", 9)
        deadline = time.time() + 5
        while tracing.policy_version("critic") != 9 and time.time() < deadline:
            time.sleep(0.02)
        assert tracing.policy_version() == 0  # two names: no guess
    finally:
        tracing.settings.policy_refresh = refresh


def test_the_versions_read_every_store_through_one_named_protocol_and_nothing_else(tmp_path):
    """``PolicyLogReader`` names what is read from the store: every store is one; a sink of the user's that only
    writes is never asked, and this process's own versions hold there."""
    from lightning_rl import diagnostics
    from lightning_rl.settings import Settings
    from lightning_rl.store import InMemoryStore, SQLiteStore
    from lightning_rl.tracer.versions import PolicyLogReader, PolicyVersions

    class WriteOnlySink:  # a user's own sink: it keeps spans, no policy log
        def write_span(self, row):
            pass

    store = SQLiteStore(tmp_path / "versions.db")
    try:
        assert isinstance(store, PolicyLogReader) and isinstance(InMemoryStore(), PolicyLogReader)
        store.record_policy("policy", 4, served_as="policy@v4")
        settings = Settings.from_env()
        settings.policy_refresh = 0.0
        versions = PolicyVersions(settings, lambda: store)
        assert versions.version("policy") == 4 and versions.served_as("policy") == ("policy@v4", 4)
        versions.set(5, "policy", served_as="policy@v5")  # this process's own publish, newer than the store's
        assert versions.version("policy") == 5 and versions.own("policy") == 5
        versions.forget("policy")
        deadline = time.time() + 5
        while versions.version("policy") != 4 and time.time() < deadline:
            time.sleep(0.02)
        assert versions.own("policy") is None and versions.version("policy") == 4
    finally:
        store.close()
    sink = WriteOnlySink()
    failed = diagnostics.counters().get("reading published policy versions", 0)
    versions = PolicyVersions(settings, lambda: sink)
    versions.set(2, "policy")
    assert versions.version("policy") == 2 and versions.served_as("policy") is None
    assert versions.canary("prod", "r-1", "policy") is None
    assert not isinstance(sink, PolicyLogReader)
    time.sleep(0.05)
    assert diagnostics.counters().get("reading published policy versions", 0) == failed  # never asked: nothing failed


def test_only_the_first_read_of_a_process_waits_and_a_read_in_flight_is_not_asked_again():
    """A read of the store's publishes that hangs (a locked or far store) holds up the first call that asks,
    for half a second at most, and no other call: before, every call waited half a second while the first
    read was in flight, and every call after an interval re-checked the sink's protocol (microseconds) and
    the reading thread until the read came back."""
    import threading

    from lightning_rl.settings import Settings
    from lightning_rl.tracer.versions import PolicyVersions

    release, asked, checked = threading.Event(), [], []

    class SlowLog:
        def write_span(self, row):
            pass

        def latest_policies(self):
            asked.append(time.monotonic())
            release.wait(10)
            return {}

        def latest_decisions(self):
            return {}

    sink = SlowLog()

    def get_sink():
        checked.append(1)
        return sink

    settings = Settings.from_env()
    settings.policy_refresh = 60.0
    versions = PolicyVersions(settings, get_sink)
    versions.set(3, "policy")
    try:
        t0 = time.monotonic()
        assert versions.version("policy") == 3
        first = time.monotonic() - t0
        assert 0.4 < first < 2.0, first  # the first read waited its half second, then the local version
        t0 = time.monotonic()
        for _ in range(200):
            assert versions.version("policy") == 3 and versions.served_as("policy") is None
        assert time.monotonic() - t0 < 0.45  # no call waits on the read in flight (one wait is 0.5 s)
        assert len(asked) == 1 and len(checked) == 1  # one read, one look at the sink, within the interval
    finally:
        release.set()
