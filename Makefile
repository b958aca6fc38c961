# Two commands for a new user: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
DEMO_SECONDS ?= 20
PYTEST_ARGS ?=
# Worker processes for the tests not marked `serial` (pytest-xdist); 1 runs everything in one process.
TEST_WORKERS ?= 2
# Other Pythons the devices run (3.10: JetPack 6, 3.12: JetPack 7); missing ones are skipped with a note.
EXTRA_PYTHONS ?= python3.10 python3.12

.PHONY: demo test lint test-pythons venv system-deps bench device-check device-simulate clean

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

# The whole suite; the skips must be exactly those tests/expected_skips.txt expects on this machine.
# Then the interpreter-sensitive subset on each of EXTRA_PYTHONS (scripts/test_pythons.py).
# The suite includes the simulated device check (tests/test_device_simulate.py: what `make device-simulate` runs).
test: $(STAMP) system-deps lint
	$(PY) scripts/check_skips.py --workers $(TEST_WORKERS) -- -q -rs $(PYTEST_ARGS)
	$(PY) scripts/test_pythons.py $(EXTRA_PYTHONS)

# The rules the tools enforce: ruff, import-linter (layers, no cycles), mypy over kernel/, engines/, agent/ and deploy/.
lint: $(STAMP)
	VENV=$(VENV) bash scripts/lint.sh

# Only the subset on the extra Pythons, one cached venv each (.venv-py310, .venv-py312).
test-pythons: $(STAMP) system-deps
	$(PY) scripts/test_pythons.py $(EXTRA_PYTHONS)

bench: $(STAMP)
	$(PY) benchmarks/pipeline.py --out out/bench-pipeline.json

# On an NVIDIA GPU machine (Jetson or not), with what is installed there: one JSON report, path printed last.
device-check:
	bash scripts/device-check.sh

# The device check on this machine against the stand-ins of each modelled TensorRT release (tests/simulate), in a
# venv installed exactly as docs/device-reports/README.md says (.venv-py310-device, cached): a test of the device
# check itself, reports in out/device-check-simulated/. `make test` runs the same in tests/test_device_simulate.py.
DEVICE_RELEASES ?= 8.6.1 10.3.0 11.1.0
device-simulate: $(STAMP)
	@py="$$($(PY) -m tests.simulate.venv)" && for release in $(DEVICE_RELEASES); do \
	    echo "=== simulated device check: TensorRT $$release"; \
	    PYTHON="$$py" bash scripts/device-check.sh --simulate $$release || exit 1; \
	done

clean:
	rm -rf $(VENV) .venv-py* out .pytest_cache
