# rlcu developer commands. `make demo` and `make test` work on a fresh machine.
PY ?= python3
# a CPU build of torch when none is installed (a GPU machine brings its own)
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.6.0

.PHONY: install install-test demo lint test test-fast gpu-check bench

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	@$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q "$(TRITON_SPEC)"
	$(PY) -m pip install -q -e .

install-test: install
	$(PY) -m pip install -q -e ".[test]"

demo: install
	rlcu demo --out runs/demo

# ruff (lint + import order, rules in pyproject.toml) before the tests
lint:
	$(PY) -m ruff check src tests bench

test: install-test
	$(PY) -m ruff check src tests bench
	$(PY) -m pytest -q --durations=15

# On the device machine: GPU-marked tests, then the benchmarks, a table last, JSON under $$OUT.
gpu-check:
	bash bench/gpu_check.sh
