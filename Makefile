# `make demo` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# CPU build by default; a GPU user installs the CUDA build of torch into .venv first (see README).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast install install-dev clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(VPY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/meshtune demo

# four workers on two cores (half of the suite's time is processes waiting: timeouts, rendezvous, a node's
# start-up; each process computes on one thread, tests/conftest.py), each taking whole modules, the longest first;
# PYTEST_WORKERS= runs serially
PYTEST_WORKERS ?= -n 4 --dist loadscope --no-loadscope-reorder

# the sources' bytecode written once: where PYTHONDONTWRITEBYTECODE is set, each of the suite's hundreds of
# processes would otherwise compile meshtune again
test: install-dev
	$(VPY) -m compileall -q src tests
	$(VPY) -m pytest -q $(PYTEST_WORKERS) $(PYTEST_ARGS)

# the tests that start no process (no torchrun, no ranks, no subprocess): for local iteration
test-fast: install-dev
	$(VPY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info
