#!/usr/bin/env bash
# For a lent GPU machine (no internet there, 64 MiB carried per call): PyTorch, transformers and peft
# are already installed there; the model is created on the machine. Prints JSON lines to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, peft, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" >&2
pip install --no-deps --no-index -e . >/dev/null 2>&1 || export PYTHONPATH="$PWD:${PYTHONPATH:-}"
# the local trainer's step in bf16 (LoRA, the 0.5B shape): tokens/s, MFU, peak memory
python bench/gpu_train_step.py --prompt 1024 --response 1024 --batch 16 --micro-batch 4
python bench/gpu_train_step.py --prompt 2048 --response 2048 --batch 8 --micro-batch 2
# the bf16 vs fp32 log-prob gap and the importance-ratio spread it causes, on the same weights
python bench/logprob_precision.py --batch 8 --prompt 64 --response 256
# verl's LoRA sync: the unmerged-adapter actor (bf16 compute) vs the engine's merged weights sent in bf16, with the
# fp32 merge as the control (its gap must be ~0)
python bench/logprob_precision.py --lora-merge-bf16 --lora-rank 32 --batch 8 --prompt 64 --response 256
