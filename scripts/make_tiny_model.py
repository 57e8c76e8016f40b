#!/usr/bin/env python
"""Create a tiny Qwen2-architecture model and tokenizer locally (no downloads).

The tokenizer is character-level (one token per printable ASCII character, newline and tab; a
byte-level vocabulary without merges) plus
Qwen-style special tokens and a chat template that renders tools and tool calls in the Hermes format
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) that vLLM's ``hermes`` parser reads.
Character-level matters: BPE merges across the prompt/response boundary make a prompt tokenize
differently from how it was trained, and every token decodes to valid text on its own.

Usage: python scripts/make_tiny_model.py --out .cache/tiny-qwen2 [--seed 0] [--layers 2] [--hidden 128]
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ALPHABET = [c for c in string.printable if c not in "\x0b\x0c\r"]  # printable ASCII, \n, \t

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall a tool as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call>"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}"
    "<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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


def make_tiny_model(out: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 128) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

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
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=pad, eos_token_id=[im_end, pad], pad_token_id=pad).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "lightning_rl_tiny.json").write_text(json.dumps({"seed": seed, "layers": layers, "hidden": hidden}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    path = make_tiny_model(args.out, seed=args.seed, layers=args.layers, hidden=args.hidden)
    print(f"tiny model written to {path}")


if __name__ == "__main__":
    main()
