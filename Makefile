# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kernorch demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

.PHONY: setup demo test
