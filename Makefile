# Two commands do all set-up on a fresh machine with only Python 3.11 and pip:
#   make reproduce   run the main job (notebooks on the embedded tiny CPU default) into the
#                    ignored workspace rollout_lab_out/: the tracked tree stays as it is
#   make test        run the test suite: lint, then every test (what .ci/run calls)
# While working:
#   make test-fast   the tests not marked slow (no notebook execution, subprocess runs, distributed,
#                    torch.compile or Triton-interpreter tests, nothing over ~0.5 s, one case of each
#                    costly parametrized test): about 50 s on 2 CPU cores
#   make lint        ruff check (rules in pyproject.toml's [tool.ruff])
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: reproduce test test-fast lint install clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch before the package, whose bare 'torch>=2.4' would pull a multi-GB CUDA build on a CPU-only
# Linux machine: scripts/install_torch.py keeps a torch that imports, else installs the CPU build where
# there is no NVIDIA driver (`$(PY) scripts/install_torch.py --dry-run` prints its choice).
$(STAMP): $(PY) pyproject.toml scripts/install_torch.py
	$(PY) scripts/install_torch.py
	$(PY) -m pip install -q -e ".[notebooks,test]"
	touch $(STAMP)

install: $(STAMP)

reproduce: $(STAMP)
	$(PY) -m rollout_lab.cli reproduce

lint: $(STAMP)
	$(PY) -m ruff check rollout_lab tests scripts examples

test: lint
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/bench_planner.py

clean:
	rm -rf $(VENV) build .pytest_cache
