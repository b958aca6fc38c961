# Two commands for a new user: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
DEMO_SECONDS ?= 20
PYTEST_ARGS ?=

.PHONY: demo test venv system-deps bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[demo,test]'
	touch $(STAMP)

venv: $(STAMP)

# Services and tools the tests use: Mosquitto (real broker), ffmpeg (stream source tests).
system-deps:
	@bash scripts/install-system-deps.sh

demo: $(STAMP)
	$(VENV)/bin/edge-agent run --duration $(DEMO_SECONDS)

test: $(STAMP) system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/pipeline.py --out out/bench-pipeline.json

clean:
	rm -rf $(VENV) out .pytest_cache
