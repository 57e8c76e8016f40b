"""A verl checkpoint to what serving takes: a LoRA adapter and a merged model folder (``export-model
--verl-checkpoint``).

verl saves an FSDP checkpoint per saved step (``trainer.default_local_dir/global_step_N/actor``: sharded state
dicts and a ``huggingface/`` folder with the config and tokenizer, no weights). ``export_verl_checkpoint``
runs verl's own model merger on it (``verl.model_merger``, FSDP backend) and writes under ``out_dir``:

* ``merged/``: a plain Hugging Face model folder (the trained weights; with LoRA, the adapter folded in),
  which vLLM serves as it is, and ``export-model --adapter`` and ``policies promote`` read;
* ``adapter/`` (when verl trained a LoRA, ``actor_rollout_ref.model.lora.rank`` > 0): the PEFT adapter, naming
  its base model, which ``policies promote`` (the gate), ``vllm_lora`` publishing and ``policies rollback``
  load into a vLLM that serves that base with ``--enable-lora``;
* ``lightning_rl_export.json``: what it was made from.

verl's merger writes a LoRA checkpoint's base weights and its adapter side by side (``lora_adapter/``); the base
it names is the checkpoint's own (``huggingface/`` config, the weights verl started from), given by
``base_model`` or found in the checkpoint's ``lightning_rl`` config record when ``train verl`` made it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ...errors import ConfigurationError


def actor_folder(checkpoint: str | Path) -> Path:
    """The actor folder of a verl checkpoint given as ``global_step_N`` or ``global_step_N/actor``."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigurationError(f"--verl-checkpoint {str(path)!r} does not exist; give trainer.default_local_dir/"
                                 "global_step_N of a run saved with trainer.save_freq")
    needed = ("huggingface/config.json", "fsdp_config.json", "model_world_size_*_rank_0.pt")
    for candidate in (path, path / "actor"):
        if all(any(candidate.glob(name)) for name in needed):
            return candidate
    raise ConfigurationError(f"--verl-checkpoint {str(path)!r} is not a verl FSDP checkpoint (no {', '.join(needed)} in "
                             "it or in its actor/); give trainer.default_local_dir/global_step_N of a run saved with "
                             "trainer.save_freq")


def export_verl_checkpoint(checkpoint: str | Path, out_dir: str | Path, *,
                           base_model: str | Path | None = None, dtype: str = "float32",
                           merge: bool = True) -> dict[str, Any]:
    """Write ``merged/`` (and ``adapter/`` for a LoRA run) under ``out_dir`` from a verl checkpoint (module doc);
    returns what was written (``{"merged": Path | None, "adapter": Path | None, ...}``). ``merge=False``: a LoRA
    run's adapter only, no merged model (what a publish records: the trainer exports every saved step)."""
    actor, out = actor_folder(checkpoint), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigurationError(f"--out {str(out)!r} is not empty; give a new folder (nothing is overwritten)")
    try:
        from verl.model_merger.base_model_merger import ModelMergerConfig
        from verl.model_merger.fsdp_model_merger import FSDPModelMerger
    except ImportError as exc:  # the CLI turns it into one line naming the extra (errors.missing_dependency)
        raise ImportError("exporting a verl checkpoint needs verl: pip install 'lightning-rl[verl]'",
                          name=exc.name or "verl") from exc
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    work = out / ".verl_merger"  # what verl's merger writes: the model, and lora_adapter/ for a LoRA
    try:
        FSDPModelMerger(ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(actor), target_dir=str(work),
                                          hf_model_config_path=str(actor / "huggingface"))).merge_and_save()
    except Exception as exc:  # noqa: BLE001 - a damaged or partial checkpoint: one line, nothing left behind
        shutil.rmtree(out if made else work, ignore_errors=True)
        raise ConfigurationError(f"verl's model merger could not read {str(actor)!r} ({type(exc).__name__}: "
                                 f"{str(exc)[:200]}); give a complete checkpoint folder") from None
    adapter = None
    if not (work / "lora_adapter").is_dir():
        work.rename(out / "merged")
    else:
        base = Path(base_model) if base_model is not None else _recorded_base(actor)
        if base is None or not (base / "config.json").is_file():
            shutil.rmtree(work)
            raise ConfigurationError(f"{str(actor)!r} holds a LoRA and its base model is not known here: give the model "
                                     "verl trained from (actor_rollout_ref.model.path) with --base-model DIR")
        adapter = out / "adapter"
        shutil.copytree(work / "lora_adapter", adapter)
        shutil.rmtree(work)
        settings = json.loads((adapter / "adapter_config.json").read_text())
        settings["base_model_name_or_path"] = str(base.resolve())
        (adapter / "adapter_config.json").write_text(json.dumps(settings, indent=1))
        from ..export_model import merge_adapter

        if merge:
            merge_adapter(adapter, out / "merged", base_model=base, dtype=dtype)
    merged = out / "merged" if (out / "merged").is_dir() else None
    record = {"verl_checkpoint": str(actor.resolve()), "adapter": str(adapter) if adapter else None,
              "merged": str(merged) if merged else None, "exported_at": time.time()}
    (out / "lightning_rl_export.json").write_text(json.dumps(record, indent=1))
    return {"merged": merged, "adapter": adapter, "verl_checkpoint": actor}


def _recorded_base(actor: Path) -> Path | None:
    """The base model ``train verl`` recorded next to the checkpoints (``lightning_rl_run.json``), if any."""
    for folder in (actor.parent.parent, actor.parent):
        record = folder / "lightning_rl_run.json"
        if record.is_file():
            path = json.loads(record.read_text()).get("model_path")
            return Path(path) if path else None
    return None
