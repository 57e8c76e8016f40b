#!/usr/bin/env python
"""The log-prob gap between a bfloat16 and a float32 forward of the same weights, and the importance-ratio spread
it causes (what a bf16 trainer sees against an fp32 engine's log-probs, with no update between them).

The model samples its own responses (float32, temperature 1: the tokens an engine would have sampled), then both
precisions score them: per response token, |logp_bf16 - logp_fp32| and the importance ratio
exp(logp_bf16 - logp_fp32) that a PPO/IS correction would apply, and per sequence the product of those ratios.
A model folder (``--model-dir``, e.g. the project's tiny warm-started model) gives realistic, peaked
distributions; without one, a Qwen2 of the 0.5B shape with random weights is built on the machine (nothing to
download), whose flat distributions understate the gap (``--tiny``: a small random shape, for a quick check).

``--lora-merge-bf16`` measures instead the gap verl's LoRA weight sync opens (verl 0.9.1,
``_merged_lora_per_tensor_param``): the FSDP actor scores tokens with the adapter unmerged, its fp32 masters
computed in bf16, while the engine samples from the adapter merged into the base weights and sent in bfloat16.
The model is wrapped in a PEFT LoRA on every linear layer (``--lora-rank``, ``--lora-alpha``) whose B matrices
are seeded random values (``--lora-init-std``) rather than PEFT's zeros, so the adapter moves the model as a
trained one does. Five log-probs of the same tokens, one JSON line per comparison (actor minus engine):

* ``actor_bf16``: the unmerged adapter, fp32 weights under bf16 autocast (every matmul in bf16, as with FSDP's
  ``param_dtype=bf16``), and ``actor_fp32`` the same in fp32;
* ``engine_bf16_merged``: a copy merged (``merge_and_unload``) and then cast whole to bfloat16, forward in bf16;
* ``merged_fp32``: the merged copy before the cast: against ``actor_fp32`` it is the control (merging is exact
  up to float reassociation, so its gap must be ~0; a gap there is a flaw of the measurement, not of the sync);
* ``base_fp32``: the adapter disabled: against ``actor_fp32`` it shows how much the adapter moves the model (a
  merged bf16 engine whose gap nears it has rounded the adapter away).

Both bf16 sides round every weight a matmul sees; what differs is where: the engine rounds the sum, round(W + s·BA),
the actor rounds its parts, round(W)x + s·round(B)round(A)x. An update smaller than half a bf16 step of W
(2^-9 to 2^-8 of |W|) is lost from the engine's weights while the actor still sees it.

The responses are sampled by ``engine_bf16_merged``: in verl the engine samples and the actor rescores the
engine's tokens, and the importance ratio is taken at those tokens, so where the engine puts too much mass is
where its samples land (the ratio has mean 1 under the engine's sampling, not the actor's). The engine here is
transformers in bf16, not vLLM's kernels: the figure is the cost of the merge-and-round, not of kernel choice.

Run on a GPU:  python bench/logprob_precision.py            (0.5B shape, random weights)
               python bench/logprob_precision.py --lora-merge-bf16 --response 256
Check on CPU:  python bench/logprob_precision.py --model-dir .cache/tiny-qwen2 --device cpu [--lora-merge-bf16]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys

import torch

#: the importance-weight cap of lightning-rl's packaged verl config (algorithm.rollout_correction.rollout_is_threshold)
IS_THRESHOLD = 2.0
OUTSIDE_CAP = f"token_ratio_outside_1/{IS_THRESHOLD:g}_{IS_THRESHOLD:g}"
#: (comparison, actor side, engine side) of --lora-merge-bf16, the headline first
LORA_COMPARISONS = (
    ("bf16_actor_vs_bf16_merged_engine", "actor_bf16", "engine_bf16_merged"),
    ("fp32_actor_vs_bf16_merged_engine", "actor_fp32", "engine_bf16_merged"),
    ("control_fp32_actor_vs_fp32_merged", "actor_fp32", "merged_fp32"),
    ("bf16_actor_vs_fp32_actor", "actor_bf16", "actor_fp32"),
    ("adapter_effect_fp32_actor_vs_base", "actor_fp32", "base_fp32"),
)


def response_logprobs(model, sequences: torch.Tensor, prompt_len: int, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad(), torch.autocast(device_type=sequences.device.type, dtype=dtype,
                                         enabled=dtype != torch.float32):
        logits = model(sequences).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def sample(model, prompts: torch.Tensor, response: int) -> torch.Tensor:
    """Exactly ``response`` new tokens per prompt at temperature 1, no truncation of the distribution."""
    with torch.no_grad():
        return model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=response, min_new_tokens=response, pad_token_id=0)


def gap_stats(logp: torch.Tensor, reference: torch.Tensor) -> dict:
    """The per-token gap of ``logp`` against ``reference`` and the importance ratio exp(logp - reference)."""
    gap = (logp - reference).abs()
    ratio = torch.exp(logp - reference)
    seq_ratio = torch.exp((logp - reference).sum(dim=1))
    return {
        "tokens": int(gap.numel()), "mean_abs_logprob_gap": round(gap.mean().item(), 6),
        "max_abs_logprob_gap": round(gap.max().item(), 6),
        "max_abs_prob_gap": round((logp.exp() - reference.exp()).abs().max().item(), 6),
        "token_ratio_min": round(ratio.min().item(), 5), "token_ratio_max": round(ratio.max().item(), 5),
        "token_ratio_std": round(ratio.std().item(), 6),
        "token_ratio_outside_0.8_1.25": round(((ratio < 0.8) | (ratio > 1.25)).float().mean().item(), 6),
        "seq_ratio_min": round(seq_ratio.min().item(), 5), "seq_ratio_max": round(seq_ratio.max().item(), 5),
    }


def figures(value: float) -> float:
    """``value`` to three significant figures."""
    return float(f"{value:.3g}")


def lora_gap_stats(actor: torch.Tensor, engine: torch.Tensor) -> dict:
    """``gap_stats`` plus the gap's quantiles, the share of tokens past the importance-weight cap, and the
    sequence log-ratio (finite where the sequence ratio over- or underflows). The gaps have three significant
    figures, not six decimals: the control's gap is below 1e-6, a flat vocabulary's probabilities too, and
    they must still read as numbers."""
    gap = (actor - engine).abs().flatten()
    ratio = torch.exp(actor - engine)
    seq_log_ratio = (actor - engine).sum(dim=1)
    quantiles = torch.quantile(gap, torch.tensor([0.5, 0.9, 0.99, 0.999], device=gap.device))
    return {
        **gap_stats(actor, engine),
        "mean_abs_logprob_gap": figures(gap.mean().item()), "max_abs_logprob_gap": figures(gap.max().item()),
        "max_abs_prob_gap": figures((actor.exp() - engine.exp()).abs().max().item()),
        **{f"abs_logprob_gap_q{q}": figures(v.item()) for q, v in zip(("50", "90", "99", "99.9"), quantiles)},
        OUTSIDE_CAP: round(((ratio < 1 / IS_THRESHOLD) | (ratio > IS_THRESHOLD)).float().mean().item(), 6),
        "seq_log_ratio_min": round(seq_log_ratio.min().item(), 5),
        "seq_log_ratio_max": round(seq_log_ratio.max().item(), 5),
        "mean_engine_logprob": round(engine.mean().item(), 4),
    }


def build_model(args: argparse.Namespace):
    """The fp32 model, on the CPU: ``--model-dir``, else a Qwen2 with random weights (0.5B shape, or ``--tiny``)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if args.model_dir:
        return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32), args.model_dir
    if args.tiny:
        shape, name = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=256, vocab_size=512), "qwen2-tiny-shape-random"
    else:
        shape, name = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, vocab_size=151936), "qwen2-0.5B-shape-random"
    config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=args.prompt + args.response + 8)
    return Qwen2ForCausalLM(config), name


def with_random_lora(model, rank: int, alpha: int, init_std: float, seed: int):
    """``model`` under a PEFT LoRA on every linear layer (not the head), its B matrices N(0, init_std) drawn from
    ``seed`` (PEFT starts them at zero: an adapter that changes nothing would show no merge gap)."""
    import peft

    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, init_std, generator=generator)
    return model


def report(rows: dict[str, dict], columns: tuple[str, ...]) -> None:
    """A table on stderr (one row per entry of ``rows``), then each row as a JSON line on stdout."""
    print(f"{'':<36}" + "".join(f"{c:>{len(c) + 2}}" for c in columns), file=sys.stderr)
    for label, result in rows.items():
        print(f"{label:<36}" + "".join(f"{result[c]!s:>{len(c) + 2}}" for c in columns), file=sys.stderr)
    for result in rows.values():
        print(json.dumps(result))


def lora_merge_bf16(args: argparse.Namespace, head: dict, model, vocab: int) -> None:
    actor = with_random_lora(model, args.lora_rank, args.lora_alpha, args.lora_init_std, args.seed)
    actor = actor.to(args.device).eval()
    merged = copy.deepcopy(actor).merge_and_unload().eval()
    engine = copy.deepcopy(merged).to(torch.bfloat16)
    prompts = torch.randint(1, vocab, (args.batch, args.prompt), device=args.device)
    sequences = sample(engine, prompts, args.response)
    logps = {
        "actor_bf16": response_logprobs(actor, sequences, args.prompt, torch.bfloat16),
        "actor_fp32": response_logprobs(actor, sequences, args.prompt, torch.float32),
        "engine_bf16_merged": response_logprobs(engine, sequences, args.prompt, torch.bfloat16),
        "merged_fp32": response_logprobs(merged, sequences, args.prompt, torch.float32),
    }
    with actor.disable_adapter():
        logps["base_fp32"] = response_logprobs(actor, sequences, args.prompt, torch.float32)
    settings = {"lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha, "lora_init_std": args.lora_init_std,
                "target_modules": "all-linear", "sampled_by": "engine_bf16_merged", "batch": args.batch,
                "prompt": args.prompt, "response": args.response, "seed": args.seed}
    rows = {}
    for comparison, actor_side, engine_side in LORA_COMPARISONS:
        stats = lora_gap_stats(logps[actor_side], logps[engine_side])
        rows[comparison] = {**head, "mode": "lora_merge_bf16", "comparison": comparison, "actor": actor_side,
                            "engine": engine_side, **stats, **settings}
        assert all(math.isfinite(v) for k, v in stats.items()
                   if isinstance(v, float) and not k.startswith("seq_ratio")), rows[comparison]
    report(rows, ("max_abs_logprob_gap", "mean_abs_logprob_gap", "max_abs_prob_gap", "token_ratio_min",
                  "token_ratio_max", OUTSIDE_CAP))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="a model folder (default: 0.5B shape, random weights)")
    parser.add_argument("--tiny", action="store_true", help="a small random shape (no --model-dir), for a quick check")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-merge-bf16", action="store_true",
                        help="measure verl's LoRA sync instead: unmerged-adapter actor vs merged bf16 engine")
    parser.add_argument("--lora-rank", type=int, default=32, help="with --lora-merge-bf16 (default 32)")
    parser.add_argument("--lora-alpha", type=int, default=32, help="with --lora-merge-bf16 (default 32)")
    parser.add_argument("--lora-init-std", type=float, default=1e-2,
                        help="with --lora-merge-bf16: the std of the random B matrices (default 0.01)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, model_name = build_model(args)
    vocab = model.config.vocab_size
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    head = {"bench": "logprob_precision", "device": name, "model": model_name}
    if args.lora_merge_bf16:
        lora_merge_bf16(args, head, model, vocab)
        return
    model = model.to(args.device).eval()
    prompts = torch.randint(1, vocab, (args.batch, args.prompt), device=args.device)
    sequences = sample(model, prompts, args.response)
    fp32 = response_logprobs(model, sequences, args.prompt, torch.float32)
    bf16 = response_logprobs(model, sequences, args.prompt, torch.bfloat16)
    result = {**head, **gap_stats(bf16, fp32), "mean_fp32_logprob": round(fp32.mean().item(), 4)}
    assert all(math.isfinite(v) for v in result.values() if isinstance(v, float)), result
    print(f"{'':<28}{'value':>14}", file=sys.stderr)
    for key, value in result.items():
        print(f"{key:<28}{value!s:>14}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
