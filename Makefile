# Two entry points for users: `make demo` (the main job) and `make test` (everything).
# Each one sets up its own environment on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint check bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kvproto demo

test: setup
	@bash scripts/test.sh

lint: setup
	$(VENV)/bin/ruff check kvproto tests
	$(VENV)/bin/mypy

check: setup
	$(VENV)/bin/kvproto check --all

bench: setup
	$(VENV)/bin/kvproto bench ledger
	$(VENV)/bin/kvproto bench transfer
	$(VENV)/bin/kvproto bench wire

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis kvproto/tla/states
	find kvproto tests scripts examples -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
