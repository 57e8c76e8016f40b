#!/usr/bin/env python
"""Create a tiny Qwen2-architecture model and tokenizer locally (no downloads).

The tokenizer is character-level (one token per printable ASCII character, newline and tab; a
byte-level vocabulary without merges) plus
Qwen-style special tokens and a chat template that renders tools and tool calls in the Hermes format
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) that vLLM's ``hermes`` parser reads.
Character-level matters: BPE merges across the prompt/response boundary make a prompt tokenize
differently from how it was trained, and every token decodes to valid text on its own.

With ``--warm-start-steps N`` it is first trained (supervised, a few minutes on 2 CPU cores) on
synthetic calculator conversations, so that it knows the tool-call format and calls the tool in
about ``--tool-fraction`` of its answers; the rest are (mostly wrong) direct guesses.

The build is as reproducible as torch allows: one seed drives the data and the initial weights,
torch runs deterministic algorithms on a fixed number of threads (``--threads``, not the machine's
core count), and the script prints a fingerprint (a hash of the weights and the greedy answer to a
fixed prompt) that it also writes to ``lightning_rl_tiny.json``. Two machines with different CPUs
may still differ in the last bits of a float, so tests never rely on what the model says.

Usage: python scripts/make_tiny_model.py --out .cache/tiny-qwen2 [--seed 0] [--layers 2] [--hidden 128]
       [--warm-start-steps 600] [--tool-fraction 0.3] [--threads 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import string
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ALPHABET = [c for c in string.printable if c not in "\x0b\x0c\r"]  # printable ASCII, \n, \t

# Tools are rendered compactly ("Tools: calculator(expression)") so that a tiny model's sequences
# stay short; tool calls and results use the Hermes tags that vLLM's hermes parser reads.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:"
    "{% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}"
    " {{ fn.name }}({{ (fn.parameters.properties if fn.parameters is defined and fn.parameters.properties is defined else {}) | join(', ') }})"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    "<tool_call>{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (space is 'Ġ', newline 'Ċ')."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # transformers >= 5 loads any model_type=qwen2 tokenizer through Qwen2Tokenizer, which imposes
    # its own byte-level pre-tokenizer. A byte-level vocabulary with *no merges* is therefore
    # character-level under that pipeline in every transformers version (and in vLLM).
    to_unicode = _byte_to_unicode()
    vocab = {to_unicode[ord(c)]: i for i, c in enumerate(ALPHABET)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|unk|>",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


ASSISTANT_TURN, TURN_END = "<|im_start|>assistant\n", "<|im_end|>"
SYSTEM_PROMPTS = ("Answer with the number.", "You are a careful calculator agent.", "Be exact.", "")


def synthetic_trace(rng, tool: bool) -> list[dict]:
    """One calculator conversation: a tool call then the tool's result (``tool``), or a direct guess."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    # Mostly one system prompt (the demo agent's): digits then sit at a fixed offset from where they
    # are copied, which a tiny model learns quickly; the others keep it usable with framework prompts.
    system = SYSTEM_PROMPTS[2] if rng.random() < 0.7 else rng.choice(SYSTEM_PROMPTS)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": f"What is {a}+{b}?"})
    if tool:
        args = json.dumps({"expression": f"{a}+{b}"})
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": args}}]},
            {"role": "tool", "content": str(a + b), "tool_call_id": "call_0"},
            {"role": "assistant", "content": str(a + b)},
        ]
    else:  # a direct answer is a guess, usually wrong: the tool is what makes the agent right
        messages.append({"role": "assistant", "content": str(a + b + rng.choice([-10, -1, 1, 10, rng.randint(-30, 30)]))})
    return messages


def encode_with_mask(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on assistant-generated tokens only
    (their content and closing <|im_end|>); tool results and prompts are 0.

    The conversation is rendered once: an assistant message's tokens start after its
    ``<|im_start|>assistant\n`` and end with its ``<|im_end|>``, and the template renders each message after
    the ones before it, so the token count of the text before a mark is where it falls in the ids (the
    tokenizer is character-level, and a mark is never split). The same ids and mask as rendering each
    prefix of the conversation, at a fraction of the cost (the build's fingerprint is unchanged)."""
    full = tokenizer.apply_chat_template(messages, tools=tools or [CALCULATOR_TOOL], tokenize=False)
    ids = tokenizer.encode(full, add_special_tokens=False)
    mask = [0] * len(ids)
    at = 0
    for message in messages:
        if message["role"] != "assistant":
            continue
        at = full.index(ASSISTANT_TURN, at) + len(ASSISTANT_TURN)
        close = full.index(TURN_END, at) + len(TURN_END)
        start = len(tokenizer.encode(full[:at], add_special_tokens=False))
        end = len(tokenizer.encode(full[:close], add_special_tokens=False))
        mask[start:end] = [1] * (end - start)
        at = close
    return ids, mask


def coding_traces(count: int, seed: int, right_fraction: float):
    """The coding-fix family's warm-start conversations (examples/coding_fix/traces.py) and its tools."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "coding_fix"))
    import tools as coding_tools
    import traces

    return traces.conversations(count, seed=seed, right_fraction=right_fraction), coding_tools.TOOLS


def warm_start(model, tokenizer, *, steps: int, seed: int, tool_fraction: float = 0.3, batch: int = 16,
               lr: float = 2e-3, log_every: int = 100, family: str = "calculator", right_fraction: float = 0.25,
               conversations: int = 3000) -> None:
    """Supervised warm start on synthetic traces, so the policy starts imperfect, not random. ``calculator``: it
    knows the tool-call format and calls the tool in about ``tool_fraction`` of its answers. ``coding``: it runs the
    tests, reads the file, edits the line and runs them again, and its edit is the fix in about ``right_fraction``
    of the ``conversations`` it learns from (drawn once, then sampled)."""
    import random

    import torch

    rng = random.Random(seed)
    coding, tools = coding_traces(conversations, seed, right_fraction) if family == "coding" else (None, None)
    encoded = [encode_with_mask(tokenizer, c, tools) for c in coding] if coding else None
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 50) * max(0.1, 1 - i / steps))
    model.train()
    for step in range(steps):
        rows = ([rng.choice(encoded) for _ in range(batch)] if encoded else
                [encode_with_mask(tokenizer, synthetic_trace(rng, rng.random() < tool_fraction)) for _ in range(batch)])
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((batch, width), pad, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, (ids, mask) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
            labels[i, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"warm start step {step:5d}/{steps}  loss {loss.item():.3f}", flush=True)
    model.eval()


FINGERPRINT_MESSAGES = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 12+30?"}]


def fingerprint(model, tokenizer) -> dict:
    """A hash of the weights (names, dtypes, shapes, bytes) and the greedy answer to a fixed prompt."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    ids = tokenizer.apply_chat_template(FINGERPRINT_MESSAGES, tools=[CALCULATOR_TOOL], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=48, do_sample=False)
    greedy = tokenizer.decode(out[0, len(ids):], skip_special_tokens=False)
    return {"weights_sha256": digest.hexdigest()[:16], "greedy": greedy}


def make_tiny_model(out: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 128,
                    warm_start_steps: int = 0, tool_fraction: float = 0.3, threads: int = 2,
                    family: str = "calculator", right_fraction: float = 0.25, batch: int = 16) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    # Reproducible: the same kernels in the same order whatever the machine's core count.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    # Exactly the tokenizer size: a padded vocabulary lets the engine sample ids no tokenizer can decode.
    vocab_size = len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,  # the CPU attention backend needs head_dim 64
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=im_end,
        pad_token_id=pad,
        use_sliding_window=False,
    )
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if warm_start_steps:
        warm_start(model, tokenizer, steps=warm_start_steps, seed=seed, tool_fraction=tool_fraction, family=family,
                   right_fraction=right_fraction, batch=batch)
    model.eval()
    generation = GenerationConfig(bos_token_id=pad, eos_token_id=[im_end, pad], pad_token_id=pad)
    model.generation_config = generation
    prints = fingerprint(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "lightning_rl_tiny.json").write_text(json.dumps({
        "seed": seed, "layers": layers, "hidden": hidden, "warm_start_steps": warm_start_steps,
        "tool_fraction": tool_fraction, "threads": threads, "torch": torch.__version__, "fingerprint": prints,
        "family": family, **({"right_fraction": right_fraction, "batch": batch} if family == "coding" else {})}))
    print(f"fingerprint: weights sha256 {prints['weights_sha256']}  greedy {prints['greedy']!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="Supervised steps on synthetic calculator traces (0 = random weights).")
    parser.add_argument("--tool-fraction", type=float, default=0.3,
                        help="Share of warm-start traces that call the calculator (the rest guess).")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads during the build (fixed, so that the result does not depend on the machine)")
    parser.add_argument("--family", choices=("calculator", "coding"), default="calculator",
                        help="what the warm start teaches: calculator conversations, or the coding-fix agent's")
    parser.add_argument("--right-fraction", type=float, default=0.25,
                        help="coding: share of warm-start conversations whose edit is the fix (the rest edit wrong)")
    parser.add_argument("--batch", type=int, default=16, help="warm-start conversations per step")
    args = parser.parse_args()
    path = make_tiny_model(args.out, seed=args.seed, layers=args.layers, hidden=args.hidden,
                           warm_start_steps=args.warm_start_steps, tool_fraction=args.tool_fraction,
                           threads=args.threads, family=args.family, right_fraction=args.right_fraction,
                           batch=args.batch)
    print(f"tiny model written to {path}")


if __name__ == "__main__":
    main()
