#!/usr/bin/env python
"""The log-prob gap between a bfloat16 and a float32 forward of the same weights, and the importance-ratio spread
it causes (what a bf16 trainer sees against an fp32 engine's log-probs, with no update between them).

The model samples its own responses (float32, temperature 1: the tokens an engine would have sampled), then both
precisions score them: per response token, |logp_bf16 - logp_fp32| and the importance ratio
exp(logp_bf16 - logp_fp32) that a PPO/IS correction would apply, and per sequence the product of those ratios.
A model folder (``--model-dir``, e.g. the project's tiny warm-started model) gives realistic, peaked
distributions; without one, a Qwen2 of the 0.5B shape with random weights is built on the machine (nothing to
download), whose flat distributions understate the gap.

Run on a GPU:  python bench/logprob_precision.py            (0.5B shape, random weights)
Check on CPU:  python bench/logprob_precision.py --model-dir .cache/tiny-qwen2 --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch


def response_logprobs(model, sequences: torch.Tensor, prompt_len: int, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad(), torch.autocast(device_type=sequences.device.type, dtype=dtype,
                                         enabled=dtype != torch.float32):
        logits = model(sequences).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="a model folder (default: 0.5B shape, random weights)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    if args.model_dir:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        vocab = model.config.vocab_size
    else:
        config = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                             max_position_embeddings=args.prompt + args.response + 8)
        with tempfile.TemporaryDirectory():
            model = Qwen2ForCausalLM(config)
        vocab = config.vocab_size
    model = model.to(args.device).eval()
    prompts = torch.randint(1, vocab, (args.batch, args.prompt), device=args.device)
    with torch.no_grad():
        sequences = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                   top_k=0, top_p=1.0, max_new_tokens=args.response, min_new_tokens=args.response,
                                   pad_token_id=0)
    fp32 = response_logprobs(model, sequences, args.prompt, torch.float32)
    bf16 = response_logprobs(model, sequences, args.prompt, torch.bfloat16)
    gap = (bf16 - fp32).abs()
    ratio = torch.exp(bf16 - fp32)
    seq_ratio = torch.exp((bf16 - fp32).sum(dim=1))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {
        "bench": "logprob_precision", "device": name, "model": args.model_dir or "qwen2-0.5B-shape-random",
        "tokens": int(gap.numel()), "mean_abs_logprob_gap": round(gap.mean().item(), 6),
        "max_abs_logprob_gap": round(gap.max().item(), 6),
        "max_abs_prob_gap": round((bf16.exp() - fp32.exp()).abs().max().item(), 6),
        "token_ratio_min": round(ratio.min().item(), 5), "token_ratio_max": round(ratio.max().item(), 5),
        "token_ratio_std": round(ratio.std().item(), 6),
        "token_ratio_outside_0.8_1.25": round(((ratio < 0.8) | (ratio > 1.25)).float().mean().item(), 6),
        "seq_ratio_min": round(seq_ratio.min().item(), 5), "seq_ratio_max": round(seq_ratio.max().item(), 5),
        "mean_fp32_logprob": round(fp32.mean().item(), 4),
    }
    assert all(math.isfinite(v) for v in result.values() if isinstance(v, float)), result
    print(f"{'':<28}{'value':>14}", file=sys.stderr)
    for key, value in result.items():
        print(f"{key:<28}{value!s:>14}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
