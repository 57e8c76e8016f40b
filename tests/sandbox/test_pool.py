"""Pools of sandboxes per snapshot (bounded, a cap on starts, a liveness check, reset on return, a lifetime past the
try's deadline) and where agents meet them: ``lrl.sandbox()`` in a rollout (each command a tool span), runners that
give each try a sandbox and score it there with the protected files restored, and sandbox failures kept out of the
gradient."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.diagnostics import counters
from lightning_rl.errors import ConfigurationError, SandboxError
from lightning_rl.records import RolloutStatus
from lightning_rl.sandbox import SANDBOX_BACKENDS, BwrapSandbox, SandboxPool, Snapshot
from lightning_rl.trainer_bridge.failures import failure_kind
from lightning_rl.trainer_bridge.runner import Runner


@pytest.fixture
def snapshot(tmp_path):
    (tmp_path / "task" / "tests").mkdir(parents=True)
    (tmp_path / "task" / "tests" / "test_it.sh").write_text("grep -q fixed answer.txt\n")
    (tmp_path / "task" / "answer.txt").write_text("broken\n")
    with Snapshot(tmp_path / "task") as snap:
        yield snap


def test_a_pool_hands_out_live_sandboxes_reset_and_bounded(snapshot):
    before = counters()
    with SandboxPool(snapshot, size=2, warm=1) as pool:
        assert pool.prewarm() == 1 and pool.stats()["idle"] == 1
        with pool.acquire() as a:
            a.run(["sh", "-c", "echo mine > note.txt"])
            with pool.acquire() as b:
                assert b is not a and b.run(["ls"]).stdout.split() == ["answer.txt", "tests"]
                with pytest.raises(SandboxError, match="no sandbox was free within 0.2 s"):
                    with pool.acquire(timeout=0.2):
                        pass
                got = []

                def wait_for_one():
                    with pool.acquire() as box:  # no timeout: it waits for a free slot
                        got.append(box)

                waiter = threading.Thread(target=wait_for_one)
                waiter.start()
                time.sleep(0.3)
                assert waiter.is_alive() and not got  # waiting, not refused at once (it was, with timeout=None)
            waiter.join(10)
            assert got and not waiter.is_alive()
        with pool.acquire() as again:  # a returned one, reset: the last try's writes are gone
            assert again.run(["ls"]).stdout.split() == ["answer.txt", "tests"]
            again.close()  # died in use: not handed out again
        with pool.acquire() as fresh:
            assert fresh.alive()
    after = counters()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("sandbox_started", "sandbox_reused", "sandbox_resets")}
    assert grew["sandbox_started"] == 2 and grew["sandbox_reused"] >= 2 and grew["sandbox_resets"] >= 2


def test_no_more_than_max_starting_start_at_once(snapshot, monkeypatch):
    real = BwrapSandbox.__init__

    def slow_start(self, *args, **kwargs):
        time.sleep(0.2)
        real(self, *args, **kwargs)

    monkeypatch.setattr(BwrapSandbox, "__init__", slow_start)
    with SandboxPool(snapshot, size=8, max_starting=2) as pool:
        def one():
            with pool.acquire():
                time.sleep(0.1)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pool.most_starting == 2


def test_a_sandbox_held_past_its_lifetime_is_taken_back(snapshot):
    with SandboxPool(snapshot, size=1, try_timeout=0.2, lifetime_margin=0.1) as pool:
        assert pool.lifetime == pytest.approx(0.3)
        with pool.acquire() as box:
            time.sleep(0.4)
            with pool.acquire(timeout=5) as other:  # the expired one was reaped, its slot freed
                assert not box.alive() and other.alive()
    with pytest.raises(ConfigurationError, match="size=0"):
        SandboxPool(snapshot, size=0)
    with pytest.raises(ConfigurationError, match="try_timeout"):
        SandboxPool(snapshot, try_timeout=-1)


def test_lrl_sandbox_is_the_trys_own_and_its_commands_are_tool_spans(traced, snapshot):
    @lrl.trace
    def agent(task):
        box = lrl.sandbox()
        assert box is not None and lrl.sandbox().box is box.box  # one per try
        done = box.run(["sh", "-c", "cat answer.txt; echo fixed > answer.txt; exit 4"])
        return float(done.exit_code)

    with SandboxPool(snapshot, size=2) as pool, lrl.sandboxes(pool):
        assert agent({"i": 1}) == 4.0
    (rollout,) = traced.rollouts()
    (tool,) = [s for s in traced.spans(rollout.rollout_id) if s.name == "execute_tool sandbox"]
    assert orjson.loads(tool.attributes[semconv.TOOL_ARGUMENTS]) == ["sh", "-c", "cat answer.txt; echo fixed > "
                                                                          "answer.txt; exit 4"]
    result = orjson.loads(tool.attributes[semconv.TOOL_RESULT])
    assert result["exit_code"] == 4 and result["ended"] == "exit" and result["stdout"] == "broken\n"
    with pytest.raises(ConfigurationError, match="inside a traced agent"):
        lrl.sandbox()


def test_a_runner_gives_each_try_a_sandbox_and_scores_it_with_the_tests_restored(traced, snapshot):
    @lrl.trace
    def agent(task):
        box = lrl.sandbox()
        box.run(["sh", "-c", task["script"]])

    def score(task, box):
        return 1.0 if box.run(["sh", "tests/test_it.sh"]).ok else 0.0

    scripts = {"honest": "echo fixed > answer.txt",
               "cheat": "echo true > tests/test_it.sh",  # edits the test instead of the answer
               "nothing": "true"}
    groups = {k: traced.enqueue({"script": v}, n=2)[0].group_id for k, v in scripts.items()}
    with SandboxPool(snapshot, size=3) as pool:
        Runner(traced, agent, concurrency=3, sandboxes=pool, score=score,
               protect=["tests"]).run_until_done(list(groups.values()))
    rewards = {k: {traced.rewards(e.rollout_id)[0].value for e in traced.queue_entries([g])} for k, g in groups.items()}
    assert rewards == {"honest": {1.0}, "cheat": {0.0}, "nothing": {0.0}}
    assert counters().get("sandbox_protected_restored", 0) >= 2


def within(seconds, fn):
    """``fn()``'s result, or a failure if it has not returned in ``seconds`` (its thread is left behind)."""
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    assert out, f"still waiting after {seconds} s"
    return out[0]


def test_acquire_async_waits_for_a_free_sandbox_off_the_loops_default_executor(snapshot):
    # A coroutine waiting for a sandbox once blocked a thread of the loop's default executor; with them all
    # waiting, the give-back that would free one queued behind them. Here the default executor has one thread.
    async def one(pool):
        async with pool.acquire_async() as box:
            await asyncio.sleep(0.05)
            return box.run(["sh", "-c", "echo fixed > answer.txt"]).ok

    async def all_of(pool):
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        return await asyncio.wait_for(asyncio.gather(*(one(pool) for _ in range(3))), timeout=60)

    with SandboxPool(snapshot, size=1) as pool:
        assert within(60, lambda: asyncio.run(all_of(pool))) == [True, True, True]
        assert pool.stats()["in_use"] == 0


def test_a_cancelled_wait_for_a_sandbox_gives_back_the_one_it_gets_later(snapshot):
    async def scenario(pool):
        async with pool.acquire_async():
            waiting = asyncio.create_task(pool.acquire_async().__aenter__())
            await asyncio.sleep(0.2)
            waiting.cancel()
        for _ in range(100):  # the cancelled wait's thread gets the sandbox freed above, then gives it back
            await asyncio.sleep(0.05)
            if pool.stats()["in_use"] == 0:
                break
        async with pool.acquire_async(timeout=10) as box:
            return box.alive()

    with SandboxPool(snapshot, size=1) as pool:
        assert within(60, lambda: asyncio.run(scenario(pool))) is True
        assert pool.stats()["in_use"] == 0


def test_tries_waiting_for_a_free_sandbox_never_hold_up_the_tries_that_would_free_one(traced, snapshot):
    # More tries than sandboxes: the waiting ones block in the pool. They once waited in the loop's default executor
    # (6 threads on 2 cores), where the finished tries' scoring and give-back queued behind them: a bench at
    # concurrency 32 stalled for good, its leases kept alive by heartbeats. Here the default executor has one thread.
    @lrl.trace
    def agent(task):
        lrl.sandbox().run(["sh", "-c", "echo fixed > answer.txt"])

    def score(task, box):
        return 1.0 if box.run(["sh", "tests/test_it.sh"]).ok else 0.0

    group = traced.enqueue({"i": 1}, n=4)[0].group_id
    aio = asyncio.Runner()
    aio.get_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
    with SandboxPool(snapshot, size=1) as pool:
        runner = Runner(traced, agent, concurrency=4, sandboxes=pool, score=score, loop=aio)
        done = threading.Thread(target=runner.run_until_done, args=([group],), daemon=True)
        done.start()
        done.join(timeout=120)
        assert not done.is_alive(), "the runner stalled: tries waiting for a sandbox held up the ones holding one"
    aio.close()
    assert sorted(traced.rewards(e.rollout_id)[0].value for e in traced.queue_entries([group])) == [1.0] * 4


def test_a_sandbox_that_cannot_start_is_an_infrastructure_failure_after_its_retries(traced, snapshot):
    attempts = []

    @SANDBOX_BACKENDS.register("broken-for-test")
    class Broken:
        def __init__(self, *args, **kwargs):
            attempts.append(1)
            raise SandboxError("the image could not start (test)")

    @lrl.trace
    def agent(task):
        lrl.sandbox()
        return 1.0

    try:
        group = traced.enqueue({"i": 1}, n=2)[0].group_id
        with SandboxPool(snapshot, backend="broken-for-test") as pool:
            Runner(traced, agent, concurrency=2, sandboxes=pool, infra_retries=1).run_until_done([group])
    finally:
        SANDBOX_BACKENDS._entries.pop("broken-for-test", None)
        SANDBOX_BACKENDS._traits.pop("broken-for-test", None)
    assert len(attempts) == 4  # two tries, each started twice (one retry)
    for entry in traced.queue_entries([group]):
        rollout = traced.get_rollout(entry.rollout_id)
        assert rollout.status == RolloutStatus.TIMED_OUT and "SandboxError" in rollout.error
        assert failure_kind(rollout) == "infra"  # its group leaves the batch


def score_by_the_tests(task, box):  # named "module:function", as a Ray actor or a worker process is given it
    return 1.0 if box.run(["sh", "tests/test_it.sh"]).ok else 0.0


def test_a_runner_builds_its_own_pool_from_a_spec_as_ray_actors_do(traced, tmp_path):
    (tmp_path / "task" / "tests").mkdir(parents=True)
    (tmp_path / "task" / "tests" / "test_it.sh").write_text("grep -q fixed answer.txt\n")
    (tmp_path / "task" / "answer.txt").write_text("broken\n")

    @lrl.trace
    def agent(task):
        lrl.sandbox().run(["sh", "-c", "echo fixed > answer.txt; ls /nowhere"])  # the second command fails

    group = traced.enqueue({"i": 1}, n=2)[0].group_id
    before = counters()
    spec = {"folder": str(tmp_path / "task"), "setup": ["sh", "-c", "echo ready > ready.txt"], "size": 2, "warm": 2,
            "limits": {"memory_mb": 512, "processes": 64}}
    with Runner(traced, agent, concurrency=2, sandboxes=spec, score=f"{__name__}:score_by_the_tests",
                protect=["tests"]) as runner:
        pool = runner.sandboxes
        assert pool.snapshot.setup_result.ok and pool.stats()["idle"] == 2
        runner.run_until_done([group])
    assert pool.closed and not pool.snapshot.path.exists()  # built here, closed here
    assert [traced.rewards(e.rollout_id)[0].value for e in traced.queue_entries([group])] == [1.0, 1.0]
    grew = {k: counters().get(k, 0) - before.get(k, 0) for k in ("sandbox_commands", "sandbox_commands_failed",
                                                                  "sandbox_reused")}
    assert grew == {"sandbox_commands": 2, "sandbox_commands_failed": 2, "sandbox_reused": 2}
    with pytest.raises(ConfigurationError, match="at least 'folder'"):
        Runner(traced, agent, sandboxes={"size": 2})
