# Two commands do everything on a fresh clone:  make demo  and  make test.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.medflare-installed
DEMO_OUT ?= runs/demo

.PHONY: install demo test test-fast bench-overhead bench-fedmas clean

# pip (not uv/poetry) so torch==2.14.1 / torchvision==0.29.1 come from this machine's local wheel store.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip<26.2"
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

# The main job: Fed-MAS against its long-tail baseline on the built-in synthetic data (a few minutes, 2 CPU cores).
demo: install
	$(VENV)/bin/medflare compare fedmas bsm-fl --scenario hyperkvasir-like --clients 4 --rounds 8 --out $(DEMO_OUT)

# Heavy benchmarks (not part of make test); results land in runs/bench-*.
bench-overhead: install
	$(PY) benchmarks/overhead.py --out runs/bench-overhead

bench-fedmas: install
	$(PY) benchmarks/fedmas_vs_baselines.py --setting synthetic --out runs/bench-fedmas-synthetic
	$(PY) benchmarks/fedmas_vs_baselines.py --setting retina --out runs/bench-fedmas-retina

# pytest exit code 5 means "no tests collected": that must not pass as green.
test: install
	$(PY) -m pytest -q --timeout=900; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf runs .pytest_cache
