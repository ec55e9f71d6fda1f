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
# The suite's files on two workers (pytest-xdist; a file's tests stay together, in order, on one worker): most of
# its time is single-threaded compiling, and CI has 2 cores. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: demo test test-slow test-verl test-latest test-torch lock venv clean

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
	$(PY) -m pytest -q $(XDIST) --durations=25 tests

# The slow tests (pyproject's addopts leave them out of `make test`): the 1,000-example fuzz.
test-slow: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m slow tests

# veRL 0.9.1's own FSDP engine with dualkv (tests/integrations/test_verl*.py, its Ulysses on 2-4 gloo ranks), in .venv-verl: a venv over .venv's
# packages (site.addsitedir) plus veRL and the imports its engine needs, without veRL's pins (it asks for
# transformers<5.11; the suite's transformers runs its engine). The versions are the ones this target passed with.
VERL := .venv-verl
VERL_STAMP := $(VERL)/.installed
VERL_PKGS := verl==0.9.1 ray==2.60.0 tensordict==0.15.3 hydra-core==1.3.8 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 \
	codetiming==1.4.0 pylatexenc==2.11 msgpack==1.2.4 protobuf==7.36.2 requests==2.34.2 urllib3==2.8.0 \
	certifi==2026.10.19.post1 charset-normalizer==3.5.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
	referencing==0.37.0 rpds-py==2026.9.1 pyvers==0.2.3 cloudpickle==3.1.3 orjson==3.13.0 attrs==26.1.0

$(VERL_STAMP): $(STAMP)
	test -x $(VERL)/bin/python || $(PYTHON) -m venv --without-pip $(VERL)
	echo "import site; site.addsitedir('$$($(PY) -c 'import site; print(site.getsitepackages()[0])')')" \
		> "$$($(VERL)/bin/python -c 'import site; print(site.getsitepackages()[0])')/dualkv_base_venv.pth"
	$(PY) -m pip --python $(VERL)/bin/python install -q --no-deps $(VERL_PKGS)
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	$(VERL)/bin/python -m pytest -q tests/integrations/test_verl.py tests/integrations/test_verl_ulysses.py

# The suite against the newest releases of everything but torch (not run by CI): breakage is seen before a pin moves.
$(LATEST_STAMP): pyproject.toml Makefile
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade "$(TORCH_CPU)" -e ".[test,bench]"
	touch $(LATEST_STAMP)

test-latest: $(LATEST_STAMP)
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$(TORCH_CPU)" -e ".[test,bench]"
	$(LATEST)/bin/python -m pip freeze --exclude-editable | grep -E '^(torch|transformers|triton|numpy|hypothesis|expecttest|pytest)=='
	$(LATEST)/bin/python -m pytest -q $(XDIST) tests

# The suite on another torch release (not run by CI): `make test-torch TORCH=2.11.0` (the oldest the project supports,
# the GPU machine's). PyPI has only CUDA builds of older releases: several GB, run on the CPU. Everything else comes
# from constraints.txt but triton, which is the one that torch release asks for, setuptools (torch 2.11 asks for
# < 82, the lock pins 84), and numpy under triton < 3.7 (torch 2.11's 3.6 interprets kernels with int() of a
# one-element array, which numpy 2.4 refuses: the CPU tests of the Triton kernels, TRITON_INTERPRET=1, need
# numpy < 2.4 there).
TORCH ?= 2.11.0
OTHER := .venv-torch-$(TORCH)

$(OTHER)/.installed: pyproject.toml Makefile $(LOCK)
	test -x $(OTHER)/bin/python || $(PYTHON) -m venv $(OTHER)
	grep -v -E '^(torch|triton|setuptools)==' $(LOCK) > $(OTHER)/constraints.txt
	$(OTHER)/bin/python -m pip install -q "torch==$(TORCH)"
	PIP_CONSTRAINT=$(OTHER)/constraints.txt $(OTHER)/bin/python -m pip install -q "torch==$(TORCH)" -e ".[test,bench]"
	$(OTHER)/bin/python -c "import triton, sys; sys.exit(tuple(map(int, triton.__version__.split('.')[:2])) >= (3, 7))" \
		&& $(OTHER)/bin/python -m pip install -q "numpy<2.4" || true
	touch $(OTHER)/.installed

test-torch: $(OTHER)/.installed
	$(OTHER)/bin/python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
	$(OTHER)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) tests

# Rewrite constraints.txt from the newest releases (run test-latest first, then commit the lock with a message).
lock: $(LATEST_STAMP)
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$(TORCH_CPU)" -e ".[test,bench]"
	{ sed -n '/^#/p' $(LOCK); $(LATEST)/bin/python -m pip freeze --exclude-editable | grep -v '^-e'; \
	  for p in pip setuptools wheel; do echo "$$p==$$($(LATEST)/bin/python -m pip index versions $$p 2>/dev/null | sed -n 's/^[^ ]* (\(.*\))/\1/p')"; done; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) $(LATEST) $(VERL) .venv-torch-* *.egg-info .pytest_cache .hypothesis
