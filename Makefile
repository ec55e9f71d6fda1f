# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install the package with exact versions from constraints.txt
# (the environment CI passed with; moving a pin is a deliberate commit: `make lock`).
# On CPU machines torch is the CPU build (an unpinned torch pulls CUDA wheels); it is pinned in constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := constraints.txt
STAMP := $(VENV)/.installed
# The CPU build of torch for the environments that float (test-latest, lock): the newest one the machine has.
TORCH_CPU ?= torch==2.13.0
LATEST := .venv-latest
LATEST_STAMP := $(LATEST)/.installed

.PHONY: demo test test-slow test-latest lock venv clean

# PIP_CONSTRAINT reaches pip's isolated build environment too (setuptools, wheel).
$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(LOCK) $(PY) -m pip install -q pip
	PIP_CONSTRAINT=$(LOCK) $(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -c "import sys; from importlib.metadata import version as v; pins = dict(l.strip().split('==') for l in open('$(LOCK)') if '==' in l and not l.startswith('#')); bad = {n: (p, v(n)) for n, p in pins.items() if n not in ('pip', 'setuptools', 'wheel') and v(n) != p}; sys.exit(f'installed versions differ from $(LOCK): {bad}' if bad else 0)"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/grpo_tiny.py --steps 3

test: $(STAMP)
	$(PY) -m pytest -q tests

# The slow tests (pyproject's addopts leave them out of `make test`): the 1,000-example fuzz.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# The suite against the newest releases of everything but torch (not run by CI): breakage is seen before a pin moves.
$(LATEST_STAMP): pyproject.toml Makefile
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade "$(TORCH_CPU)" -e ".[test,bench]"
	touch $(LATEST_STAMP)

test-latest: $(LATEST_STAMP)
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$(TORCH_CPU)" -e ".[test,bench]"
	$(LATEST)/bin/python -m pip freeze --exclude-editable | grep -E '^(torch|transformers|triton|numpy|hypothesis|expecttest|pytest)=='
	$(LATEST)/bin/python -m pytest -q tests

# Rewrite constraints.txt from the newest releases (run test-latest first, then commit the lock with a message).
lock: $(LATEST_STAMP)
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$(TORCH_CPU)" -e ".[test,bench]"
	{ sed -n '/^#/p' $(LOCK); $(LATEST)/bin/python -m pip freeze --exclude-editable | grep -v '^-e'; \
	  for p in pip setuptools wheel; do echo "$$p==$$($(LATEST)/bin/python -m pip index versions $$p 2>/dev/null | sed -n 's/^[^ ]* (\(.*\))/\1/p')"; done; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) $(LATEST) *.egg-info .pytest_cache .hypothesis
