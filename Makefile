# The two commands of the README, and the venv they share. Nothing here needs anything installed by hand:
# the venv is created and filled on first use, and refreshed when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: test train lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install -q "torch==2.13.0" || $(VENV)/bin/python -m pip install -q "torch>=2.11,<2.15"
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q --durations=25 $(PYTEST_ARGS)

train: $(STAMP)
	$(VENV)/bin/python -m recipes.train $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
