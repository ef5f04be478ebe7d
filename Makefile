# Set-up is part of each target: `make demo` and `make test` work on a fresh machine with
# Python 3.11 and nothing else installed. TORCH pins the CPU build that CI machines carry.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recforge campaign run campaigns/demo.toml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
