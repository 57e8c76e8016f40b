"""Sandboxes against their baselines, measured in the same run (issue 55's goals):

1. a try's bwrap sandbox from a snapshot of a FILES-file folder (open, first command, close), beside a fresh full
   copy of that folder (goal: <= 50 ms p50);
2. ``true`` in a sandbox against ``true`` on the host, the same process runner (goal: <= 20 ms p50 more);
3. churn: CONCURRENCY tries at once taking sandboxes from one pool for SECONDS, each running a command that
   writes and forks; afterwards no sandbox folder, mount or control group is left, and no more than
   ``max_starting`` started at once (the issue asks 64 for 10 minutes: ``--churn-seconds 600``).

    python bench/bench_sandbox.py [--files 10000] [--runs 30] [--concurrency 64] [--churn-seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from lightning_rl.sandbox import Limits, SandboxPool, Snapshot, open_sandbox
from lightning_rl.sandbox.base import run_process


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


def make_folder(root: Path, files: int) -> Path:
    folder = root / "task"
    for i in range(files):
        sub = folder / f"pkg{i % 100:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"m{i}.py").write_text(f"X = {i}\n")
    return folder


def leftovers(since: float) -> dict[str, int]:
    tmp = Path(tempfile.gettempdir())
    return {"sandbox_folders": sum(1 for p in tmp.glob("lrl-sandbox-*") if p.stat().st_mtime >= since),
            "mounts": Path("/proc/mounts").read_text().count("lrl-sandbox"),
            "control_groups": len(list(Path("/sys/fs/cgroup").glob("*/**/lrl-sandbox-*")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-starting", type=int, default=8)
    parser.add_argument("--churn-seconds", type=float, default=60.0)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    began = time.time() - 1
    out: dict[str, object] = {"date": time.strftime("%Y-%m-%d"), "files": args.files, "runs": args.runs}
    with tempfile.TemporaryDirectory() as scratch:
        folder = make_folder(Path(scratch), args.files)
        t = time.monotonic()
        snapshot = Snapshot(folder)
        out["snapshot_made_s"] = round(time.monotonic() - t, 3)
        copies, opens, firsts = [], [], []
        for i in range(args.runs):
            t = time.monotonic()
            shutil.copytree(folder, Path(scratch) / f"copy{i}", symlinks=True)
            copies.append(time.monotonic() - t)
            shutil.rmtree(Path(scratch) / f"copy{i}")
            t = time.monotonic()
            box = open_sandbox("bwrap", snapshot=snapshot)
            opens.append(time.monotonic() - t)
            assert box.run(["test", "-f", "pkg07/m7.py"]).ok
            firsts.append(time.monotonic() - t)
            box.close()
        out["full_copy_p50_ms"] = round(p50(copies), 2)
        out["sandbox_from_snapshot_open_p50_ms"] = round(p50(opens), 2)
        out["sandbox_from_snapshot_open_and_first_command_p50_ms"] = round(p50(firsts), 2)

        host, inside = [], []
        with open_sandbox("bwrap", snapshot=snapshot) as box:
            for _ in range(args.runs):
                t = time.monotonic()
                run_process(["true"], stdin=None, env={"PATH": "/usr/bin:/bin"}, cwd=None, timeout=30, limits=Limits())
                host.append(time.monotonic() - t)
                t = time.monotonic()
                assert box.run(["true"]).ok
                inside.append(time.monotonic() - t)
        out["true_host_p50_ms"] = round(p50(host), 2)
        out["true_sandbox_p50_ms"] = round(p50(inside), 2)
        out["true_overhead_p50_ms"] = round(p50(inside) - p50(host), 2)

        done, failed, lock = [0], [0], threading.Lock()
        stop = time.monotonic() + args.churn_seconds
        pool = SandboxPool(snapshot, size=args.concurrency, max_starting=args.max_starting, start_timeout=120,
                           limits=Limits(processes=64, memory_mb=512))

        def churn() -> None:
            while time.monotonic() < stop:
                try:
                    with pool.acquire(timeout=120) as box:
                        ok = box.run(["sh", "-c", "echo x > mine.txt; (sleep 0.2 &); ls pkg01 | wc -l"], timeout=60).ok
                except Exception:  # noqa: BLE001 - counted
                    ok = False
                with lock:
                    done[0] += ok
                    failed[0] += not ok

        threads = [threading.Thread(target=churn) for _ in range(args.concurrency)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        out["churn"] = {"concurrency": args.concurrency, "seconds": args.churn_seconds, "tries": done[0],
                        "failed": failed[0], "most_starting": pool.most_starting, "max_starting": args.max_starting}
        pool.close()
        snapshot.close()
    out["left_after"] = leftovers(began)
    print(json.dumps(out, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
