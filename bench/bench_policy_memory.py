#!/usr/bin/env python
"""Memory of N LoRA policies on one base model in the local trainer: the base is held once.

Goal (issue 15): a process training N policies holds at most base + N x adapter + 10%. Each N runs in
a process of its own: it builds a ``LocalBackend(policies=[...])`` on a Qwen2-architecture model of
``--hidden``/``--layers`` (random weights, the tiny model's tokenizer), runs as many updates as the
largest N, taking the policies in turn (so every policy has its gradients and AdamW moments, and every
process does the same work), and reports its peak RSS. The baseline,
measured in the same run, is the process with one policy: ``base`` is its peak RSS less one
adapter's footprint (weights, gradients and AdamW's two moments: 4x the adapter's parameters), and
the bound for N policies is ``1.1 x (base + N x footprint)``. It also prints what each policy past
the first adds to the peak RSS, to compare with its footprint, and the seconds per update. Each N runs
once per allocator setting (``--allocators``), since the heap's retention of freed activations is what
grows with N: glibc's defaults (``LocalConfig(malloc_trim=False)``), the heap's free pages handed back
after each update (``malloc_trim=True``; the default, None, turns it on with several policies), and
blocks from 64 KiB up mapped on their own (``malloc_mmap_threshold=65536``). The last line is JSON.

Run: .venv/bin/python bench/bench_policy_memory.py [--policies 1 2 4 8] [--hidden 512 --layers 8]
     [--allocators none trim 65536]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def make_model(out: Path, hidden: int, layers: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = ROOT / ".cache" / "tiny-qwen2"
    config = AutoConfig.from_pretrained(str(tiny))
    config.hidden_size, config.num_hidden_layers = hidden, layers
    config.intermediate_size, config.num_attention_heads, config.num_key_value_heads = 2 * hidden, 8, 2
    config.layer_types = ["full_attention"] * layers
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)


def one_process(model_dir: str, n: int, updates: int, threshold: int | None, trim: bool) -> dict:
    """Runs in the child: N policies, ``updates`` updates taking the policies in turn (every process does
    the same work, so the peak differs only by what the policies hold), peak RSS and the backend's own
    byte counts."""
    import random

    from lightning_rl.records import Sample
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.local import LocalBackend

    rng = random.Random(0)
    samples = [Sample(prompt_ids=[rng.randrange(5, 90) for _ in range(48)],
                      response_ids=[rng.randrange(5, 90) for _ in range(32)], response_mask=[1] * 32,
                      reward=float(i % 2), group_id=f"g{i // 4}", rollout_id=f"r{i}") for i in range(16)]
    names = [f"policy-{i}" for i in range(n)]
    config = LocalConfig(lr=1e-4, malloc_mmap_threshold=threshold, malloc_trim=trim)
    backend = LocalBackend(model_dir, config, seed=0, device="cpu", policies=names)
    started = time.perf_counter()
    for i in range(updates):
        backend.update(samples, policy=names[i % n])
    seconds = (time.perf_counter() - started) / updates
    memory = backend.memory()
    adapter_mb = memory["policies"][names[0]]["adapter_mb"]
    return {"policies": n, "peak_rss_mb": round(peak_rss_mb(), 1), "base_mb": round(memory["base_mb"], 2),
            "adapter_mb": round(adapter_mb, 3), "footprint_mb": round(4 * adapter_mb, 3),
            "seconds_per_update": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--allocators", nargs="+", default=["none", "trim", "65536"],
                        help="none: glibc's defaults; trim: malloc_trim after each update (the default with "
                             "several policies); a number: malloc_mmap_threshold in bytes")
    parser.add_argument("--child", nargs=4, metavar=("MODEL_DIR", "N", "UPDATES", "THRESHOLD"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    counts = sorted(set([1, *args.policies]))
    if args.child:
        spec = args.child[3]
        threshold = None if spec in ("none", "trim") else int(spec)  # trim: on even with one policy, the baseline
        print(json.dumps(one_process(args.child[0], int(args.child[1]), int(args.child[2]), threshold, spec == "trim")))
        return
    out = {}
    with tempfile.TemporaryDirectory(prefix="lrl-policy-mem-") as tmp:
        make_model(Path(tmp), args.hidden, args.layers)
        child = [sys.executable, __file__, "--child", tmp]
        for threshold in args.allocators:
            allocator = {"none": "glibc's defaults (malloc_trim=False)",
                         "trim": "malloc_trim after each update (malloc_trim=True; the default with 2+ policies)"}.get(
                threshold, f"malloc_mmap_threshold={threshold} (malloc_trim=False)")
            rows = [json.loads(subprocess.run([*child, str(n), str(counts[-1]), threshold], check=True,
                                              capture_output=True, text=True).stdout.splitlines()[-1])
                    for n in counts]
            out[allocator] = report(allocator, rows, args)
    print(json.dumps({"runs": out, "all_within": {k: v["all_within"] for k, v in out.items()}}))


def report(allocator: str, rows: list[dict], args: argparse.Namespace) -> dict:
    one = rows[0]
    base = one["peak_rss_mb"] - one["footprint_mb"]
    print(f"\n{allocator}: model hidden {args.hidden}, {args.layers} layers, weights {one['base_mb']:.1f} MB; one "
          f"adapter {one['adapter_mb']:.2f} MB, with gradients and AdamW moments {one['footprint_mb']:.2f} MB")
    print(f"{'policies':>8} {'peak RSS MB':>12} {'bound MB':>10} {'within':>7} {'MB per extra policy':>20} "
          f"{'s per update':>13}")
    for row in rows:
        row["bound_mb"] = round(1.1 * (base + row["policies"] * row["footprint_mb"]), 1)
        row["within"] = row["peak_rss_mb"] <= row["bound_mb"]
        extra = row["policies"] - 1
        row["mb_per_extra_policy"] = round((row["peak_rss_mb"] - one["peak_rss_mb"]) / extra, 2) if extra else None
        print(f"{row['policies']:>8} {row['peak_rss_mb']:>12.1f} {row['bound_mb']:>10.1f} {str(row['within']):>7} "
              f"{row['mb_per_extra_policy'] if extra else '-':>20} {row['seconds_per_update']:>13.3f}")
    return {"base_rss_mb": round(base, 1), "rows": rows, "all_within": all(r["within"] for r in rows)}


if __name__ == "__main__":
    main()
