"""Supervised warm-start data: exported conversations or token samples, as training samples.

``sft_samples(data, model_dir)`` takes what ``lightning-rl export`` writes (a JSONL path, or its lines
as dicts or ``Sample`` objects): token samples as they are (the engine's ids and masks), and chat
examples (``{"messages": [...], "tools": [...]}``) rendered with the model's own chat template. A
conversation trains its last message, which must be the assistant's: the prompt is the template of
the messages before it (with the generation prompt), the response the tokens the full conversation
adds; a template whose prompt is not a token prefix of the whole is refused, naming the example.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..records import Sample


def _lines(data: str | Path | Iterable[Any]) -> list[Any]:
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.is_file():
            raise ConfigurationError(f"SFT data {str(path)!r} is not a file; export one with lightning-rl export "
                                     "--format chat (or --format tokens)")
        out = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigurationError(f"{path}:{n} is not JSON ({exc})") from None
        return out
    return list(data)


def sft_samples(data: str | Path | Iterable[Any], model_dir: str | Path) -> list[Sample]:
    tokenizer = None
    samples: list[Sample] = []
    for n, item in enumerate(_lines(data), 1):
        if isinstance(item, Sample):
            samples.append(item)
            continue
        if not isinstance(item, dict):
            raise ConfigurationError(f"SFT example {n} is a {type(item).__name__}; give chat examples "
                                     "({'messages': [...]}) or token samples")
        if "messages" not in item:
            samples.append(Sample.model_validate(item))
            continue
        messages, tools = item["messages"], item.get("tools") or None
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
            raise ConfigurationError(f"SFT example {n} must end with the assistant's message (the one it trains), "
                                     f"got {messages[-1] if messages else 'no messages'!r}")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages[:-1], tools=tools, add_generation_prompt=True,
                                                                tokenize=False), add_special_tokens=False)
        full = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False),
                                add_special_tokens=False)
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            raise ConfigurationError(f"SFT example {n}: the chat template's prompt is not a token prefix of the whole "
                                     "conversation, so its answer cannot be cut out; export tokens instead")
        response = full[len(prompt):]
        samples.append(Sample(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                              reward=item.get("reward"), rollout_id=item.get("rollout_id"),
                              group_id=item.get("group_id"), agent_name=item.get("agent")))
    if not samples:
        raise ConfigurationError("no SFT examples in the data given")
    return samples


def warm_start(data: Any, model_dir: str | Path, out_dir: str | Path, *, local: Any = None, seed: int = 0,
               epochs: int = 2, lr: float | None = None) -> tuple[dict[str, float], Path]:
    """SFT a fresh LoRA (``LocalBackend.sft``) on ``data``; saves it as ``out_dir/sft_adapter`` and its
    losses as ``out_dir/sft.json``. Returns both."""
    from .local import LocalBackend, LocalConfig

    samples = sft_samples(data, model_dir)
    backend = LocalBackend(model_dir, local or LocalConfig(), seed=seed)
    stats = backend.sft(samples, epochs=epochs, lr=lr)
    out_dir = Path(out_dir)
    path = out_dir / "sft_adapter"
    backend.adapter().save_pretrained(path)
    (out_dir / "sft.json").write_text(json.dumps({**stats, "adapter": str(path)}, indent=1))
    return stats, path
