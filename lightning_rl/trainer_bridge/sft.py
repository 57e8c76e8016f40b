"""Supervised warm-start data: exported conversations or token samples, as training samples.

``sft_samples(data, model_dir)`` takes what ``lightning-rl export`` writes (a JSONL path, a Parquet file
of token samples, or the lines as dicts or ``Sample`` objects): token samples as they are (the engine's ids and masks), and chat
examples (``{"messages": [...], "tools": [...]}``) rendered with the model's own chat template. A
conversation trains its last message, which must be the assistant's: the prompt is the template of
the messages before it (with the generation prompt), the response the tokens the full conversation
adds; a template whose prompt is not a token prefix of the whole is refused, naming the example.

Policies (``policies.py``: one policy, or a team such as ``{"planner": "planner-lora", ...}``, as
``Trainer`` takes them): each example goes to the policy of its ``agent`` (the export writes it; one
policy takes every example), and each policy's adapter is trained on its own examples, saved under
``sft_adapter/`` as ``policies.py`` lays folders out (one served name: ``sft_adapter/`` itself; several:
``sft_adapter/<served name>/``). Examples of agents without a policy are skipped and counted
(``sft_skipped_no_policy``); a policy no example reaches keeps the fresh LoRA and is named in
``sft_policies_without_data``; data that reaches no policy at all is refused.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..records import Sample
from .policies import Policies

log = logging.getLogger(__name__)


def _lines(data: str | Path | Iterable[Any]) -> list[Any]:
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.is_file():
            raise ConfigurationError(f"SFT data {str(path)!r} is not a file; export one with lightning-rl export "
                                     "--format chat (or --format tokens)")
        if path.suffix.lower() == ".parquet":
            from ..store.parquet import read_samples

            return list(read_samples(path))
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


def split_by_policy(samples: list[Sample], policies: Policies) -> tuple[dict[str, list[Sample]], int]:
    """Each sample under its agent's policy; and how many had no agent with a policy."""
    out: dict[str, list[Sample]] = {served: [] for served in policies.served}
    skipped = 0
    for sample in samples:
        served = policies.of_agent(sample.agent_name)
        if served is None:
            skipped += 1
        else:
            out[served].append(sample)
    if not any(out.values()):
        agents = sorted({str(s.agent_name) for s in samples})
        raise ConfigurationError(f"no SFT example belongs to an agent with a policy: the data's agents are {agents}, "
                                 f"the policies' are {sorted(policies.by_agent)}; export the team's rollouts (their "
                                 "examples carry 'agent'), or fix the names in policies=")
    return out, skipped


def warm_start(data: Any, model_dir: str | Path, out_dir: str | Path, *, local: Any = None, seed: int = 0,
               epochs: int = 2, lr: float | None = None,
               policies: Policies | None = None) -> tuple[dict[str, Any], Path]:
    """SFT a fresh LoRA per policy (``LocalBackend.sft``) on ``data`` (default: one policy); saves the adapters
    under ``out_dir/sft_adapter`` (module doc) and the losses as ``out_dir/sft.json``. Returns both. The
    stats are per policy (``policies``; a single served name's also at the top level), with the skip counts."""
    from .local import LocalBackend

    policies = policies or Policies.of()
    samples = sft_samples(data, model_dir)
    out_dir = Path(out_dir)
    path = out_dir / "sft_adapter"
    if path.is_dir():  # an earlier SFT's adapters: a policy without data now must not load them
        shutil.rmtree(path)
    routed, skipped = split_by_policy(samples, policies)
    backend = LocalBackend(model_dir, local, seed=seed, policies=policies.served)
    folders = policies.folders(path)
    per_policy = {name: backend.sft(mine, epochs=epochs, lr=lr, policy=name) for name, mine in routed.items() if mine}
    for name in per_policy:
        backend.adapter(name).save_pretrained(folders[name])
    stats: dict[str, Any] = {**policies.figures(per_policy), "sft_skipped_no_policy": skipped,
                             "sft_policies_without_data": [name for name, mine in routed.items() if not mine]}
    if skipped or stats["sft_policies_without_data"]:
        log.warning("SFT: %d example(s) of agents without a policy skipped; policies without data (they start from "
                    "a fresh LoRA): %s", skipped, stats["sft_policies_without_data"] or "none")
    (out_dir / "sft.json").write_text(json.dumps({**stats, "adapter": str(path)}, indent=1))
    return stats, path
