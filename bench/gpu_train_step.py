#!/usr/bin/env python
"""One local-backend training step at realistic shape: tokens per second and model FLOPs utilisation.

Builds a Qwen2 model of the 0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864,
vocab 151936) with random weights *on the machine* (nothing to download or carry), wraps it in the
local backend (LoRA rank 16 on every projection), and times ``update()`` on synthetic samples
(prompt + response tokens, GRPO groups). ``update`` runs one no-grad forward (old log-probs) and one
forward + backward: about 6 x params FLOPs per token (attention FLOPs not counted), the figure MFU
is based on, against the GPU's dense bf16 peak.

Run on a GPU:  python bench/gpu_train_step.py --prompt 1024 --response 1024 --batch 16
Check on CPU:  python bench/gpu_train_step.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_rl.records import Sample  # noqa: E402
from lightning_rl.trainer_bridge.config import LocalConfig  # noqa: E402
from lightning_rl.trainer_bridge.local import LocalBackend  # noqa: E402

BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def peak_tflops(name: str) -> float | None:
    for key, value in BF16_PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a small shape for a quick CPU check")
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if args.tiny:
        shape = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=256, vocab_size=512)
        args.prompt, args.response, args.batch, args.micro_batch, args.steps = 64, 64, 4, 2, 1
    else:
        shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    config = Qwen2Config(**shape, max_position_embeddings=args.prompt + args.response + 8, tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(tmp)
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models

        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0}, unk_token="<pad>")),
                                pad_token="<pad>").save_pretrained(tmp)
        backend = LocalBackend(tmp, LocalConfig(dtype=dtype, micro_batch_size=args.micro_batch), device=args.device)
    params = sum(p.numel() for p in backend.model.parameters())
    rng = random.Random(0)
    vocab = shape["vocab_size"]

    def batch() -> list[Sample]:
        return [Sample(prompt_ids=[rng.randrange(1, vocab) for _ in range(args.prompt)],
                       response_ids=[rng.randrange(1, vocab) for _ in range(args.response)],
                       response_mask=[1] * args.response, reward=float(i % 2), group_id=f"g{i // 4}")
                for i in range(args.batch)]

    backend.update(batch())  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        samples = batch()
        t0 = time.perf_counter()
        stats = backend.update(samples)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    tokens = args.batch * (args.prompt + args.response)
    tokens_per_s = tokens / seconds
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = args.peak_tflops or peak_tflops(name)
    achieved = 6 * params * tokens_per_s / 1e12
    result = {
        "bench": "gpu_train_step", "device": name, "dtype": dtype, "params": params,
        "batch": args.batch, "prompt": args.prompt, "response": args.response, "step_seconds_median": round(seconds, 3),
        "tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(achieved, 2),
        "peak_bf16_tflops": peak, "mfu": round(achieved / peak, 4) if peak else None,
        "loss": stats["loss"], "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if args.device.startswith("cuda") else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
