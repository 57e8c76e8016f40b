#!/usr/bin/env bash
# Build the tiny model with another seed into a temporary directory and run every vLLM-marked test
# against it (the main suite, the verl agent-loop test in .venv-verl, CrewAI and LlamaIndex in
# .venv-frameworks, Google ADK in .venv-adk, verl's own trainer end to end in .venv-verl-e2e). A test that passes only
# because of what one sampled model says fails here. Run it before resolving an issue that touches
# vLLM tests.
#
# Usage: scripts/vllm_tests_other_seed.sh [SEED] [pytest args...]     (default seed 1)
#        make test-other-seed SEED=7
# The model is built with the same arguments as `make model` (MODEL_ARGS, passed by make).
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-1}
shift $(( $# > 0 ? 1 : 0 ))
model_args=${MODEL_ARGS:---layers 4 --warm-start-steps 1200}
dir=$(mktemp -d "${TMPDIR:-/tmp}/lrl-tiny-seed${seed}-XXXXXX")
trap 'rm -rf "$dir"' EXIT

# shellcheck disable=SC2086  # model_args is a list of arguments
.venv/bin/python scripts/make_tiny_model.py --out "$dir" --seed "$seed" $model_args
export LIGHTNING_RL_TEST_MODEL_DIR="$dir"
status=0
.venv/bin/python -m pytest -q -m vllm "$@" || status=$?
if [ -x .venv-verl/bin/python ]; then
  .venv-verl/bin/python -m pytest -q -m "vllm and verl" tests/trainer_bridge "$@" || status=$?
fi
if [ -x .venv-frameworks/bin/python ]; then  # CrewAI and LlamaIndex (they pin openai < 3)
  .venv-frameworks/bin/python -m pytest -q tests/adapters/test_pinned_frameworks_vllm.py "$@" || status=$?
fi
if [ -x .venv-adk/bin/python ]; then  # Google ADK (it pins OpenTelemetry <= 1.44)
  .venv-adk/bin/python -m pytest -q tests/adapters/test_google_adk_vllm.py "$@" || status=$?
fi
if [ -x .venv-verl-e2e/bin/python ]; then  # verl's main_ppo on CPU, the checkpoint through the gate
  .venv-verl-e2e/bin/python -m pytest -q -m verl_e2e tests/verl_e2e "$@" || status=$?
fi
echo "vLLM tests against the tiny model with seed $seed: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
