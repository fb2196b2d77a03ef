# Everything creates .venv itself: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch: pip finds the local CPU wheel on our machines. Elsewhere pass
# TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" to keep CUDA wheels off CPU hosts.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install test test-pure test-gpu compat demo bench soak mutate lint typecheck clean

# The editable install compiles asyncrpc/_compiled.py's COMPILED_MODULES with mypyc
# (setup.py; docs/compiled.md), or warns and stays pure Python without a C compiler.
# $(BUILT) recompiles them in place when a source mypyc reads changes (the globs of
# BUILT_FROM in asyncrpc/_compiled.py, spelled here for make).
COMPILED_SRC := asyncrpc/errors.py $(wildcard asyncrpc/wire/*.py asyncrpc/transport/*.py)
BUILT := $(VENV)/.compiled

install: $(STAMP) $(BUILT)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,examples]"
	touch $(STAMP)

$(BUILT): $(STAMP) asyncrpc/_compiled.py $(COMPILED_SRC)
	$(PY) setup.py -q build_ext --inplace
	touch $(BUILT)

test: install
	$(PY) -m pytest -q

# The unit tests with the compiled modules switched off (ASYNCRPC_PURE_PYTHON=1): the
# Python source of every compiled module stays tested (CI runs both).
test-pure: install
	ASYNCRPC_PURE_PYTHON=1 $(PY) -m pytest -q tests/unit

# torch's own RPC test suites against asyncrpc.compat, every in-scope test (docs/compat.md);
# `make test` runs a quick subset of them.
compat: install
	ASYNCRPC_COMPAT_FULL=1 $(PY) -m pytest -q tests/compat

# The CUDA tests (docs/cuda.md); they skip without a GPU.
test-gpu: install
	$(PY) -m pytest -m gpu -v tests/integration/test_gpu.py

demo: install
	$(PY) examples/parameter_server.py

# Both frameworks side by side (README, "Performance"); writes benchmarks/results/latest.json
# and latest.png.  BENCH_ARGS="--workloads bandwidth,fanin --rounds 1" for a part of it.
BENCH_ARGS ?=
bench: install
	$(PY) benchmarks/bench_rpc.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_cuda.py

# Three workers under mixed traffic; fails on a lost call, an unexpected error or a crash.
# SOAK_ARGS="--duration 600 --json soak.json" for the long run.
SOAK_ARGS ?=
soak: install
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

# Mutation testing over the unit tests (docs/testing.md); CPU-heavy, not part of `make test`.
# What is mutated: only_mutate under [tool.mutmut] in pyproject.toml (add a module there).
# Mutants live in the Python source, so the compiled modules are switched off.
# MUTANTS narrows a run to some mutant names, e.g. MUTANTS='asyncrpc.wire.*'.  Results are
# kept in mutants/ and reused by the next run; `rm -rf mutants` starts afresh.
MUTANTS ?=
MUTATE_JOBS ?= 2
mutate: install
	ASYNCRPC_PURE_PYTHON=1 nice -n 15 $(VENV)/bin/mutmut run --max-children $(MUTATE_JOBS) $(MUTANTS)
	$(VENV)/bin/mutmut results
	$(VENV)/bin/mutmut results --all true | awk -F': ' '\
	  { sub(/^ +/, "", $$1); split($$1, name, "."); pkg = name[1] "." name[2] } \
	  $$2 == "not checked" { unrun[pkg]++; next } { total[pkg]++ } \
	  $$2 == "killed" || $$2 == "timeout" { caught[pkg]++ } \
	  END { for (p in total) printf "%-20s %5d / %5d killed (%.1f%%), %d not run\n", \
	        p, caught[p], total[p], 100 * caught[p] / total[p], unrun[p] }' | sort

lint: install
	$(VENV)/bin/ruff check asyncrpc tests examples benchmarks
	$(VENV)/bin/ruff format --check asyncrpc tests examples benchmarks

typecheck: install
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache mutants build
	find asyncrpc -name '*.so' -delete
