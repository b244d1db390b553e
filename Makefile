# The verbs a newcomer types. `make demo` and `make test` work on a fresh clone.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
# test processes: two fill two cores (2026-12-07: 509 s with two; three saturated them too;
# 2026-12-08, torch._dynamo preloaded for the ranks: 394 s)
TEST_JOBS ?= 2

.PHONY: demo test bench lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned, so pip takes the CPU build on disk and never a CUDA build
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	bash scripts/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs -n $(TEST_JOBS) --durations=15 tests

bench: $(STAMP)
	$(BIN)/python -m bench

lint: $(STAMP)
	$(BIN)/ruff check nfabric_cli tests bench

clean:
	rm -rf $(VENV) .nfabric .pytest_cache
