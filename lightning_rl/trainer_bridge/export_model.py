"""Ship a trained policy: a LoRA adapter merged into its base model (``lightning-rl export-model``).

``merge_adapter(adapter_dir, out_dir)`` loads the base model the adapter names (or ``base_model``),
applies the adapter with PEFT, folds it into the weights (``merge_and_unload``) and writes a plain
Hugging Face model directory, tokenizer included, that vLLM (or transformers) serves as it is, with no
LoRA support needed. ``lightning_rl_export.json`` in it says what it was made from.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import ConfigurationError


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, *, base_model: str | Path | None = None,
                  dtype: str = "float32") -> Path:
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ConfigurationError(f"--adapter {str(adapter_dir)!r} is not a LoRA adapter folder (no adapter_config.json); "
                                 "give one the trainer published, e.g. .cache/demo-rl/adapters/v00020")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigurationError(f"--out {str(out_dir)!r} is not empty; give a new folder (nothing is overwritten)")
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = Path(base_model) if base_model is not None else Path(config.get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise ConfigurationError(f"the base model {str(base)!r} (named by the adapter) is not a model folder here; "
                                 "give it with --base-model DIR")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigurationError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=getattr(torch, dtype))
    merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out_dir), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out_dir))
    (out_dir / "lightning_rl_export.json").write_text(json.dumps(
        {"base_model": str(base.resolve()), "adapter": str(adapter_dir.resolve()), "dtype": dtype,
         "merged_at": time.time()}, indent=1))
    return out_dir
