# Everything creates .venv itself: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch: pip finds the local CPU wheel on our machines. Elsewhere pass
# TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" to keep CUDA wheels off CPU hosts.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install test compat demo bench soak lint typecheck clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,examples]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

# torch's own RPC test suites against asyncrpc.compat, every in-scope test (docs/compat.md);
# `make test` runs a quick subset of them.
compat: install
	ASYNCRPC_COMPAT_FULL=1 $(PY) -m pytest -q tests/compat

demo: install
	$(PY) examples/parameter_server.py

bench: install
	$(PY) benchmarks/bench_rpc.py

# Three workers under mixed traffic; fails on a lost call, an unexpected error or a crash.
# SOAK_ARGS="--duration 600 --json soak.json" for the long run.
SOAK_ARGS ?=
soak: install
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

lint: install
	$(VENV)/bin/ruff check asyncrpc tests examples benchmarks
	$(VENV)/bin/ruff format --check asyncrpc tests examples benchmarks

typecheck: install
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
