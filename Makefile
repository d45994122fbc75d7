# areal-k8s: `make demo` runs the asynchronous RL demo on this machine, `make test` runs the test suite.
# Both create the virtual environment they need (.venv) on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEMO   := .cache/demo
PROTOS := $(wildcard proto/areal_k8s/api/v1/*.proto)
STUBS  := services/api/v1/.generated

.PHONY: venv proto crd dashboards demo demo-assets test bench clean images e2e-kind

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# gRPC stubs are build outputs of proto/ (the editable install generates them too)
proto: $(STUBS)
$(STUBS): $(PROTOS) proto/generate.py $(VENV)/.installed
	$(PY) proto/generate.py
	touch $@

# the Grafana dashboards the chart ships are generated from services/observability/dashboards.py; a test checks them
dashboards: proto
	$(PY) -m areal_k8s.observability.dashboards --write
	$(PY) -m areal_k8s.common.metrics --write README.md

# the RLJob CRD is generated from the job schema (services/common/config.py); a test checks it is current
crd: proto
	$(PY) -m areal_k8s.k8s_operator.schema --write

demo-assets: proto
	$(PY) -m areal_k8s.demo.build --out $(DEMO)

demo: demo-assets
	$(VENV)/bin/arealctl run examples/demo.yaml --fresh

test: proto
	$(VENV)/bin/pytest

# the container images of images/ (needs a Docker engine; IMAGES="cpu operator" for a subset, PUSH=1 to push)
images:
	bash images/build.sh

# the chart, the CPU image and the demo RLJob on a kind cluster (needs docker, kind, kubectl and helm)
e2e-kind:
	bash scripts/e2e-kind.sh

# not a test: timings, reported as ratios measured side by side in one run (results in bench/results/)
bench: demo-assets
	$(PY) bench/sync_vs_async.py

clean:
	rm -rf $(VENV) build runs .cache .pytest_cache .hypothesis services/api/v1/*_pb2*.py* $(STUBS)
