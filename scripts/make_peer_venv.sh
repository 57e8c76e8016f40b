#!/usr/bin/env bash
# Builds the peer's own environment (Microsoft Agent Lightning 0.3.0) for side-by-side store
# benchmarks: scripts/make_peer_venv.sh [VENV_DIR]  (default .venv-peer, relative to the repo root).
# Skips the build when VENV_DIR/.stamp exists. No torch: agentlightning 0.3.0 does not need it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-peer}"
PYTHON="${PYTHON:-python3}"
PIP_FLAGS=(--disable-pip-version-check --no-input -q)

if [[ -f "$VENV/.stamp" ]]; then
    echo "$VENV is already built (remove $VENV/.stamp to rebuild)" >&2
    exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install "${PIP_FLAGS[@]}" -c constraints-peer.txt agentlightning==0.3.0
# litellm (pulled through litellm[proxy]) would fetch its model cost map from the internet.
LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c \
    "import agentlightning, opentelemetry.sdk.version as v; print('agentlightning', agentlightning.__version__, 'opentelemetry-sdk', v.__version__)"
touch "$VENV/.stamp"
