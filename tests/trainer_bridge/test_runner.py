"""Runners on the task queue: outcomes, timeouts, and a runner killed with SIGKILL mid-rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

import lightning_rl as lrl
from lightning_rl import diagnostics
from lightning_rl.records import QueueStatus, RolloutStatus
from lightning_rl.trainer_bridge.runner import Runner


async def _agent_impl(task):
    await asyncio.sleep(0.01)
    if task["kind"] == "boom":
        raise ConnectionError("model server returned 400")
    if task["kind"] == "slow":
        await asyncio.sleep(5)
    return 1.0


def test_outcomes_failures_and_timeouts_are_never_successes(traced):
    agent = lrl.trace(_agent_impl)
    groups = [traced.enqueue({"kind": k}, n=2)[0].group_id for k in ("ok", "boom", "slow")]
    Runner(traced, agent, concurrency=6, rollout_timeout=0.5).run_until_done(groups)
    by_kind = {}
    for e in traced.queue_entries(groups):
        by_kind.setdefault(e.task["kind"], set()).add(e.outcome)
        assert traced.get_rollout(e.rollout_id).status == e.outcome  # queue and rollout agree
    assert by_kind == {"ok": {RolloutStatus.SUCCEEDED}, "boom": {RolloutStatus.FAILED},
                       "slow": {RolloutStatus.TIMED_OUT}}
    assert "400" in traced.get_rollout(traced.queue_entries([groups[1]])[0].rollout_id).error
    samples, _ = lrl.samples(traced)
    assert {s.rollout_id for s in samples} <= {e.rollout_id for e in traced.queue_entries([groups[0]])}


def test_sync_agents_run_with_their_context(traced):
    @lrl.trace
    def agent(task):
        lrl.emit_reward(0.5)
        return 1.0

    groups = [traced.enqueue({"i": i}, n=3)[0].group_id for i in range(2)]
    Runner(traced, agent, concurrency=3).run_until_done(groups)
    entries = traced.queue_entries(groups)
    assert len(entries) == 6 and {e.outcome for e in entries} == {RolloutStatus.SUCCEEDED}
    assert all(len(traced.rewards(e.rollout_id)) == 2 for e in entries)


DOOMED_RUNNER = """
import asyncio, sys, time
import lightning_rl as lrl
from lightning_rl.trainer_bridge.runner import Runner
store = lrl.configure(store=sys.argv[1])

@lrl.trace
async def agent(task):
    print("started", flush=True)
    await asyncio.sleep(60)   # killed long before this ends
    return 1.0

Runner(store, agent, runner_id="doomed", lease_seconds=1.0, rollout_timeout=None).run_until_done(sys.argv[2:])
"""


def test_killed_runner_lease_expires_and_task_is_retried(tmp_path):
    db = tmp_path / "runs.db"
    store = lrl.SQLiteStore(db)
    (entry,) = store.enqueue({"q": 1}, n=1)
    proc = subprocess.Popen([sys.executable, "-c", DOOMED_RUNNER, f"sqlite:///{db}", entry.group_id],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(0.3)  # let the rollout row reach the file
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    previous = lrl.tracer.tracing._sink
    lrl.configure(store=store)
    try:
        @lrl.trace
        async def agent(task):
            return 1.0

        Runner(store, agent, runner_id="healthy", lease_seconds=5).run_until_done([entry.group_id])
    finally:
        lrl.tracer.tracing.set_sink(previous)
    (done,) = store.queue_entries([entry.group_id])
    assert done.outcome == RolloutStatus.SUCCEEDED and done.tries == 2
    statuses = {r.status for r in store.rollouts()}
    assert statuses == {RolloutStatus.TIMED_OUT, RolloutStatus.SUCCEEDED}  # the partial try kept, apart
    assert [t.rollout_id for t in lrl.trajectories(store, status="succeeded")] == [done.rollout_id]
    store.close()


class _AwayForTheFirstTry(lrl.SQLiteStore):
    """A store whose answer to the first try's complete comes only once the retry is leased: meanwhile the
    runner's lease ran out and its own free slot leased the retry (the soak test's failure, a server restart)."""

    def complete(self, queue_id, runner, outcome, **kw):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the store is away until the entry is on its second try
            (entry,) = [e for e in self.queue_entries(self.groups) if e.queue_id == queue_id]
            if entry.tries > 1:
                break
            time.sleep(0.02)
        return super().complete(queue_id, runner, outcome, **kw)


def test_a_late_outcome_of_a_try_never_ends_its_retry_on_the_same_runner(tmp_path):
    store = _AwayForTheFirstTry(tmp_path / "runs.db")
    (entry,) = store.enqueue({"q": 1}, n=1, max_tries=3)
    store.groups = [entry.group_id]
    previous = lrl.tracer.tracing._sink
    lrl.configure(store=store)
    diagnostics.reset()
    ran = []
    try:
        @lrl.trace
        def agent(task):
            ran.append(lrl.current_rollout_id())
            if len(ran) == 2:  # the retry runs while the first try's outcome still comes back
                time.sleep(3.0)
                ran.append(store.queue_entries(store.groups)[0].status)
            return 1.0

        Runner(store, agent, runner_id="same", concurrency=2, lease_seconds=1.5, wait=0.1).run_until_done(store.groups)
    finally:
        lrl.tracer.tracing.set_sink(previous)
    (done,) = store.queue_entries(store.groups)
    assert done.tries == 2 and len(ran) == 3 and done.rollout_id == ran[1]  # the retry ran, on the same runner
    assert ran[2] == QueueStatus.LEASED  # not ended by the first try's outcome while it ran
    assert diagnostics.counters().get("queue_results_refused_stale_try") == 1  # which came late, and was refused
    assert store.get_rollout(done.rollout_id).status == done.outcome == RolloutStatus.SUCCEEDED
    assert store.get_rollout(ran[0]).status == RolloutStatus.TIMED_OUT
    store.close()


def test_async_clients_survive_repeated_runs(traced, vllm_url):
    """A pooled AsyncOpenAI client must keep working across run_until_done calls (one loop)."""
    import openai

    client = openai.AsyncOpenAI(base_url=vllm_url, api_key="EMPTY")

    @lrl.trace
    async def agent(task):
        await client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        return 1.0

    with Runner(traced, agent, concurrency=4) as runner:
        for _ in range(3):
            groups = [traced.enqueue({"i": i}, n=2)[0].group_id for i in range(2)]
            runner.run_until_done(groups)
    outcomes = {e.outcome for e in traced.queue_entries()}
    assert outcomes == {RolloutStatus.SUCCEEDED}, [traced.get_rollout(e.rollout_id).error for e in traced.queue_entries()]


test_async_clients_survive_repeated_runs = pytest.mark.vllm(test_async_clients_survive_repeated_runs)


def test_sync_agent_in_worker_processes(tmp_path):
    from lightning_rl.trainer_bridge.runner import run_in_processes

    from .sync_agents import counting_agent

    db = tmp_path / "runs.db"
    store = lrl.SQLiteStore(db)
    groups = [store.enqueue({"i": i}, n=3)[0].group_id for i in range(4)]
    codes = run_in_processes(f"sqlite:///{db}", counting_agent, groups, processes=2)
    assert codes == [0, 0]
    entries = store.queue_entries(groups)
    assert len(entries) == 12 and {e.outcome for e in entries} == {RolloutStatus.SUCCEEDED}
    assert None not in {e.runner for e in entries} and len({e.runner for e in entries}) <= 2  # who completed each
    finals = sorted(lrl.trajectory(store, e.rollout_id).final_reward for e in entries)
    assert finals == [0.0] * 6 + [1.0] * 6
    store.close()


def test_local_functions_cannot_go_to_processes(tmp_path):
    from lightning_rl.trainer_bridge.runner import run_in_processes

    @lrl.trace
    def local_agent(task):
        return 1.0

    with pytest.raises(lrl.ConfigurationError, match="module level"):
        run_in_processes(f"sqlite:///{tmp_path / 'x.db'}", local_agent, [])


def test_trainer_runs_sync_agents_in_processes(tmp_path):
    from lightning_rl.trainer_bridge.trainer import Trainer

    from .sync_agents import counting_agent

    store = lrl.SQLiteStore(tmp_path / "runs.db")
    trainer = Trainer(agent=counting_agent, tasks=[{"i": 1}, {"i": 2}], store=store, model_dir="unused",
                      server_url="http://127.0.0.1:9", out_dir=tmp_path, n=2, processes=2, progress=False)
    groups = trainer._run_groups(counting_agent, [{"i": 1}, {"i": 2}], 2, "train", "test")
    rollout_ids, counts = trainer._outcomes(groups)
    assert counts == {"succeeded": 4} and len(rollout_ids) == 4
    store.close()
