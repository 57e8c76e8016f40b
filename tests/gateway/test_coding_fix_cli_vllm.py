"""The coding-fix task family (examples/coding_fix, issue 56) run through a real coding-agent CLI: Claude Code (the
pinned CLI of examples/cli_agents) in each try's own bwrap sandbox, through the gateway, against the real vLLM server
with a long window (``vllm_long_url``), driven by the runner with a sandbox pool per task and the family's score.

The tiny model is not expected to fix anything: what is checked is what was recorded, whatever it says. Each try's
first answer is a Bash call the test knows (guided decoding, tests/gateway/forcing_proxy.py), run by the CLI in the
try's sandbox: it shows the working folder is the try's copy of its task, that another try's file and a host secret
beside the task are not there, and leaves a file of its own. Then, as a CLI that edited the tests would, the tests are
replaced with ones that pass; the runner restores them and scores the try with the task's own tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.gateway import CommandFailed
from lightning_rl.records import RewardSource, RolloutStatus
from lightning_rl.sandbox import open_sandbox
from lightning_rl.sandbox.pool import PoolPerTask
from lightning_rl.trainer_bridge.runner import Runner

from ..conftest import SERVED_NAME
from .forcing_proxy import ForcingProxy
from .machine_pace import cli_time_limit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "coding_fix"))  # tasks, tools
import tasks as family  # noqa: E402
import tools  # noqa: E402

pytestmark = [pytest.mark.vllm]
CLAUDE = Path(__file__).resolve().parents[2] / "examples" / "cli_agents" / "node_modules" / ".bin" / "claude"
needs_claude = pytest.mark.skipif(not CLAUDE.is_file(), reason="the Claude Code CLI of examples/cli_agents "
                                  "(make node-deps installs @anthropic-ai/claude-code 2.1.332)")
GREEDY = {"temperature": 0.0, "seed": 0}
#: the tasks (fixed seeds of the train split, seed -> difficulty): seed 1 tried twice (its pool's one sandbox, reset
#: between its tries), seed 2 once
DIFFICULTY, TRIES = {1: 0, 2: 1}, {1: 2, 2: 1}
SEEDS = tuple(DIFFICULTY)
#: what a CLI that edited the tests to pass would leave (no test of the task left; one that passes)
CHEAT = "import unittest\n\n\nclass TestPkg(unittest.TestCase):\n    def test_nothing(self):\n        pass\n"


def _mount_points_in_work() -> set[str]:
    """The top folder that the CLI's read-only install folder (its node_modules) is mounted at inside the sandbox's
    /work, when the checkout itself lies under /work (/work/main here): bwrap makes that mount point in the try's own
    folder, so the CLI sees it beside the task's files and it is left in the try's folder. Empty elsewhere."""
    install = CLAUDE.resolve().parents[0]
    while install.name != "node_modules" and install != install.parent:
        install = install.parent
    return {install.parts[2]} if install.parts[:2] == ("/", "work") and len(install.parts) > 2 else set()


@needs_claude
def test_coding_fix_tasks_through_claude_code_each_try_isolated_recorded_and_scored(traced, vllm_long_url, tmp_path):
    made = {seed: family.generate(seed, difficulty=DIFFICULTY[seed]) for seed in SEEDS}
    for task in made.values():
        family.verify(task)  # its tests fail as generated and pass with the fix
    secret = tmp_path / "secret.txt"  # a host file beside the tasks' folders
    secret.write_text("host secret 5f3a: never read in a sandbox\n")
    folders = {seed: tmp_path / f"task{seed}" for seed in SEEDS}
    limit = cli_time_limit(vllm_long_url, str(CLAUDE), calls=3)
    seen: dict[str, dict] = {}  # rollout id -> what the test saw of its try
    owner: dict[int, str] = {}  # a sandbox (id) -> the try holding it now

    def folder_of(task):  # under the pool's lock: written before its snapshot is made
        seed = task["seed"]
        return seed, made[seed].write(folders[seed])

    @lrl.trace(name="coding-fix-cli")
    async def agent(task):
        rollout_id = lrl.current_rollout_id()
        box = lrl.sandbox()
        owner[id(box.box)] = rollout_id
        mark = f"mark-{rollout_id}.txt"
        # the try's first answer may only be this call: its working folder, a host file beside its task's folder, the
        # task's folder on the host, then a file of its own and what the folder holds after it
        script = (f"pwd; ls -A; ls -A tests pkg; cat {secret} || echo SECRET-UNREADABLE; "
                  f"ls -A {folders[task['seed']]} || echo HOST-FOLDER-ABSENT; echo {rollout_id} > {mark}; "
                  "echo AFTER; ls -A")
        mine = seen[rollout_id] = {"seed": task["seed"], "mark": mark, "script": script, "box": box.folder}
        with ForcingProxy(vllm_long_url, call=("Bash", {"command": script, "description": "Look around"})) as engine:
            cli = lrl.claude_code(made[task["seed"]].prompt, upstream=engine.url, model=SERVED_NAME, tools="Bash",
                                  allowed_tools="Bash", system_prompt="You fix Python packages. Be terse.",
                                  max_turns=3, max_output_tokens=16, timeout=limit)
            try:
                await cli(task)
                mine["ended"] = "returned"
            except CommandFailed as exc:  # the run may end either way: what was recorded is what matters
                mine["ended"] = f"raised: {exc}"
        mine["forced"] = len(engine.forced)
        # as a CLI that edited the tests would leave them: tests that pass, in the try's sandbox
        box.put("tests/test_pkg.py", CHEAT)
        mine["cheat_passes"] = box.run(family.test_command(), timeout=60).ok

    def score(task, box):  # the family's score, after the runner restored the tests; the try's folder kept first
        rollout_id = owner[id(box)]
        final = tmp_path / "final" / rollout_id
        box.get_folder(".", final)
        seen[rollout_id]["final"] = final
        return tools.score(task, box)

    groups = {seed: traced.enqueue({"seed": seed}, n=TRIES[seed], max_tries=1, overrides={"sampling": GREEDY})[0]
              .group_id for seed in SEEDS}
    pools = PoolPerTask(folder_of, size=1)
    try:
        Runner(traced, agent, concurrency=1, sandboxes=pools, score=score, protect=list(family.Task.protected),
               rollout_timeout=2 * limit + 120).run_until_done(list(groups.values()))
    finally:
        pools.close()

    assert len(seen) == sum(TRIES.values())
    marks = {info["mark"] for info in seen.values()}
    extra = _mount_points_in_work()
    # a sandbox per task (its own folder on the host, none of them the task's folder); the tries of one task share its
    # pool's sandbox one after the other, reset between them
    boxes = {seed: {info["box"] for info in seen.values() if info["seed"] == seed} for seed in SEEDS}
    assert all(len(b) == 1 for b in boxes.values()) and len(set().union(*boxes.values())) == len(SEEDS), boxes
    assert not set().union(*boxes.values()) & set(folders.values())
    assert lrl.stats().get("sandbox_protected_restored") == len(seen)  # every try's tests were changed, and restored
    for seed, group in groups.items():
        task = made[seed]
        entries = traced.queue_entries([group])
        assert len(entries) == TRIES[seed]
        for entry in entries:
            rollout = traced.get_rollout(entry.rollout_id)
            assert entry.outcome == rollout.status == RolloutStatus.SUCCEEDED, rollout.error
            info = seen[entry.rollout_id]
            assert info["forced"] == 1 and info["cheat_passes"], info
            traj = lrl.trajectory(traced, entry.rollout_id)
            # every call the CLI made, recorded with the engine's token ids
            assert len(traj.llm_calls) >= 2, info  # the forced call, then the one carrying its result
            for call in traj.llm_calls:
                assert call.token_ids_source == "engine" and call.model == SERVED_NAME, call
                assert call.prompt_token_ids and call.response_token_ids
            # the forced call, run by the CLI in the try's sandbox: its working folder is its copy of the task
            (asked,) = traj.llm_calls[0].tool_calls
            assert asked.name == "Bash" and json.loads(asked.arguments)["command"] == info["script"]
            (bash,) = [t for t in traj.tool_spans if t.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) == asked.id]
            shown = bash.attributes[semconv.TOOL_RESULT]
            before, _, after = shown.partition("AFTER")
            words = before.split()
            assert words[0] == "/work", shown
            assert {Path(p).name for p in task.files} <= set(words), shown  # the task's own files, as generated
            assert set(words[1:words.index("pkg:")]) - {"pkg", "tests"} <= extra, shown  # nothing of another try
            assert "host secret" not in shown and "SECRET-UNREADABLE" in shown and "HOST-FOLDER-ABSENT" in shown, shown
            assert not any(m in before for m in marks), shown  # no try's file (its own not yet written)
            assert info["mark"] in after and not any(m in after for m in marks - {info["mark"]}), shown
            assert "host secret" not in json.dumps([c.input_messages for c in traj.llm_calls])
            # the reward: the task's own tests, restored after the try replaced them, run after the CLI ended
            (reward,) = traced.rewards(entry.rollout_id)
            assert reward.source == RewardSource.FUNCTION and reward.value in (0.0, 1.0)
            final = info["final"]
            assert (final / "tests" / "test_pkg.py").read_text() == task.files["tests/test_pkg.py"]
            assert (final / info["mark"]).read_text().strip() == entry.rollout_id  # the try's own file, kept
            assert {p.name for p in final.iterdir()} - {"pkg", "tests", info["mark"]} <= extra  # and no other try's
            with open_sandbox("bwrap", final) as fresh:
                assert fresh.run(family.test_command(), timeout=60).ok == (reward.value == 1.0)
            if all((final / p).read_text() == text for p, text in task.files.items()):
                assert reward.value == 0.0  # the package as generated: its bug still there
        # the task's folder on the host: as generated, none of its tries' files in it
        assert sorted(p.relative_to(folders[seed]).as_posix() for p in folders[seed].rglob("*") if p.is_file()) == \
            sorted(task.files)
        assert all((folders[seed] / p).read_text() == text for p, text in task.files.items())
