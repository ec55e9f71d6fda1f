# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the package with what it needs.
# On CPU machines torch is pinned to the CPU build (an unpinned torch pulls CUDA wheels).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test,bench]" "$(TORCH_CPU)"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/grpo_tiny.py --steps 3

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
