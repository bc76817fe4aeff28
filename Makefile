# Two commands do everything on a fresh clone:  make demo  and  make test.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.medflare-installed
DEMO_OUT ?= runs/demo

.PHONY: install demo test test-heavy test-fast lint mutants bench-overhead bench-scaling bench-peer bench-transfer flower-robust-reference bench-robust bench-fedmas bench-fedmas-cost bench-fca bench-mdhfl bench-mdhfl-cpu60 bench-ssl-fl bench-fedlsm bench-converged bench-dp bench-he bench-paper bench-paper-lease bench-fixed clean

# pip (not uv/poetry) so torch==2.14.1 / torchvision==0.29.1 come from this machine's local wheel store. pip
# byte-compiles what it installs one file at a time; compileall does the same on every core (a fresh install took
# 169 s with pip compiling, 91 s without, on 2 cores on 2026-11-28). Like pip, it skips files that do not compile.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile --upgrade "pip<26.2"
	@rm -rf custom/medflare.egg-info  # older installs wrote it there, where `nvflare job create -sd custom` copies it
	$(PY) -m pip install --quiet --no-compile -e ".[test]"
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
	@touch $(STAMP)

install: $(STAMP)

# The demo pins NumPy's and PyTorch's CPU kernels (ATen, oneDNN, MKL) to their AVX2 code, which every x86-64 CPU of
# the last decade runs. Each library otherwise picks its fastest code for the CPU at hand, floats then differ in the
# last bits between machines (even the synthetic images, by a pixel), and eight rounds of training turn that into a
# different third decimal. Unknown NumPy feature names are ignored, so the list covers NumPy 1.26 to 2.x. The pins
# narrow the spread, they do not remove it: an AMD EPYC printed 0.3070 / 0.3880 where this project's Intel CI machine
# prints the README's 0.3110 / 0.3870 (other AVX2 kernels inside the libraries); the README states the expected range.
DEMO_CPU_PINS := NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR" \
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2

# The main job: Fed-MAS against its long-tail baseline on the built-in synthetic data (a few minutes, 2 CPU cores).
demo: install
	$(DEMO_CPU_PINS) $(VENV)/bin/medflare compare fedmas bsm-fl --scenario hyperkvasir-like --clients 4 --rounds 8 --out $(DEMO_OUT) --overwrite

# Heavy benchmarks (not part of make test); results land in runs/bench-*. bench-overhead, bench-scaling and
# bench-peer end by putting their tables (every goal marked met or missed) into docs/benchmarks.md's blocks.
DOCS_TABLES = $(PY) benchmarks/docs_tables.py
# Framework cost at realistic work (issues 15, 32): ResNet-18, PneumoniaMNIST, 2 and 4 sites, one process per site
# on both sides, in FLARE's simulator and in a POC; --quick for a 1-2 min sanity run.
bench-overhead: install
	$(PY) benchmarks/overhead.py --out runs/bench-overhead
	$(DOCS_TABLES) bench-overhead runs/bench-overhead/results.md --command "make bench-overhead (simulator)"
	$(PY) benchmarks/overhead.py --env poc --out runs/bench-overhead-poc
	$(DOCS_TABLES) bench-overhead-poc runs/bench-overhead-poc/results.md --command "make bench-overhead (POC)"

# Memory, scaling and fp16 parity (issue 15): peak RSS and its growth after round 3 with 2, 4 and 8 sites over 30
# rounds (fixed total data), the 20-hospital estimate, then float32 vs float16 transfer on the demo job, 3 seeds.
bench-scaling: install
	$(PY) benchmarks/scaling.py --out runs/bench-scaling
	$(DOCS_TABLES) bench-scaling runs/bench-scaling/results.md --command "make bench-scaling"

# medflare against Flower on the same FedAvg work (issue 32): bare loop, medflare's simulator and POC, Flower's
# simulation and deployment engines, and FLARE's own FedAvg recipe (the floor under medflare's simulator side);
# ResNet-18 and cnn, PneumoniaMNIST, 2 sites. A side that fails or hangs (--side-timeout) is reported, not fatal. Flower gets its own virtual
# environment (flwr 1.42 needs protobuf < 7, medflare's has 7.x); it is a benchmark-only peer, in no medflare extra.
# pip takes torch/torchvision from this machine's local wheel store, as for medflare. BENCH_PEER_ARGS adds options
# (e.g. --quick, --clients 2 4).
FLOWER_VENV ?= .venv-flower
FLOWER_STAMP := $(FLOWER_VENV)/.flower-installed
BENCH_PEER_ARGS ?=
$(FLOWER_STAMP):
	@test -x $(FLOWER_VENV)/bin/python || $(PYTHON) -m venv $(FLOWER_VENV)
	$(FLOWER_VENV)/bin/python -m pip install --quiet --upgrade "pip<26.2"
	$(FLOWER_VENV)/bin/python -m pip install --quiet "flwr[simulation]==1.42.*" torch==2.14.1 torchvision==0.29.1 numpy
	@touch $(FLOWER_STAMP)

bench-peer: install $(FLOWER_STAMP)
	$(PY) benchmarks/peer_flower.py --flower-venv $(FLOWER_VENV) --out runs/bench-peer $(BENCH_PEER_ARGS)
	$(DOCS_TABLES) bench-peer runs/bench-peer/results.md --command "make bench-peer $(BENCH_PEER_ARGS)"

# Flower's robust aggregation functions on fixed inputs (issue 49): flwr 1.42 and numpy only, in their own venv;
# rewrites the reference tests/flare/test_robust_rules_vs_flower.py checks medflare's rules against (that test also
# reruns Flower when this venv exists).
FLOWER_RULES_VENV ?= .venv-flower-rules
flower-robust-reference:
	@test -x $(FLOWER_RULES_VENV)/bin/python || $(PYTHON) -m venv $(FLOWER_RULES_VENV)
	$(FLOWER_RULES_VENV)/bin/python -m pip install --quiet "flwr==1.42.*" numpy
	$(FLOWER_RULES_VENV)/bin/python benchmarks/robust_rules_flower.py --out benchmarks/results/robust_rules_flower.json

# The robust rules (robust.rule) against FedAvg with one hostile site among seven (issue 49): PneumoniaMNIST, cnn,
# 5 rounds, 3 seeds, through the in-process engine (the job's plan and the server's aggregation core).
bench-robust: install
	$(PY) benchmarks/robust_rules.py --out runs/bench-robust --seeds 0 1 2

# FLARE's transfer of one model alone (issue 32): two FLARE cells on loopback, each change medflare could make to
# what it hands FLARE (fp16, one buffer, chunk sizes, tensors).
bench-transfer: install
	$(PY) benchmarks/transfer.py --out runs/bench-transfer

bench-fedmas: install
	$(PY) benchmarks/fedmas_vs_baselines.py --setting synthetic --out runs/bench-fedmas-synthetic
	$(PY) benchmarks/fedmas_vs_baselines.py --setting retina --out runs/bench-fedmas-retina

# Fed-MAS's cost per part and its three shortcuts (issue 15): demo settings, then ResNet-18; 3 seeds each.
bench-fedmas-cost: install
	$(PY) benchmarks/fedmas_cost.py --model cnn --out runs/bench-fedmas-cost-cnn
	$(PY) benchmarks/fedmas_cost.py --model resnet18 --out runs/bench-fedmas-cost-resnet18

bench-fca: install
	$(PY) benchmarks/fca_vs_baselines.py --setting synthetic --out runs/bench-fca-synthetic
	$(PY) benchmarks/fca_vs_baselines.py --setting retina --out runs/bench-fca-retina

# MDH-FL vs FedMD vs local-only, label noise, 3 architectures, with the ablations and a simulator parity cell.
bench-mdhfl: install
	$(PY) benchmarks/mdhfl.py --setting synthetic --ablations --parity --out runs/bench-mdhfl-synthetic
	$(PY) benchmarks/mdhfl.py --setting retina --out runs/bench-mdhfl-retina

# The issue's MDH-FL table only, CPU-sized (about 60 CPU-min: 30 min on 2 idle cores).
bench-mdhfl-cpu60: install
	$(PY) benchmarks/mdhfl.py --setting synthetic --preset cpu60 --out runs/bench-mdhfl-synthetic
	$(PY) benchmarks/mdhfl.py --setting retina --preset cpu60 --out runs/bench-mdhfl-retina

# SSL-FL (issue 13): scratch vs Fed-MAE vs Fed-BEiT on RetinaMNIST and PneumoniaMNIST, label efficiency, Fed-MAS
# with a Fed-MAE prior. ~4 CPU-hours (one core per process: run data sets in separate processes, see
# docs/benchmarks.md); finished jobs are cached in runs/bench-ssl-fl, the tables land in benchmarks/results/.
bench-ssl-fl: install
	$(PY) benchmarks/ssl_fl.py --check-simulator
	nice -n 10 $(PY) benchmarks/ssl_fl.py --part all

# FedLSM vs its baselines and ablations under label-set mismatch (RetinaMNIST, synthetic multi-label), 3 seeds.
bench-fedlsm: install
	nice -n 10 $(PY) benchmarks/fedlsm.py --setting retina --rounds 15 --steps 10 --out runs/bench-fedlsm-retina
	nice -n 10 $(PY) benchmarks/fedlsm.py --setting synthetic-ml --rounds 15 --steps 10 --out runs/bench-fedlsm-synthetic-ml

# Evidence at convergence (issue 63): each seed paper's claim run until validation stops improving, FedAvg and
# FedAdam in every table, lr tuned per arm, 5 paired seeds; resumable (rows in benchmarks/results/converged.json).
# `python benchmarks/converged.py --dry-run` prints the plan and its CPU estimate.
bench-converged: install
	nice -n 10 $(PY) benchmarks/converged.py --workers 2

# Accuracy against ε (∞, 8, 3, 1): FedAvg with DP-SGD at every site on PneumoniaMNIST, 3 seeds (docs/privacy.md)
bench-dp: install
	nice -n 10 $(PY) benchmarks/dp_epsilon.py --rounds 5 --steps 15 --out runs/bench-dp

# Seconds and bytes per round with and without encrypted aggregation (TenSEAL CKKS), cnn and ResNet-18, 2 sites in a
# POC with HEBuilder kits (docs/privacy.md)
bench-he: install
	nice -n 10 $(PY) benchmarks/he_cost.py --models cnn resnet18 --rounds 3 --out runs/bench-he

# The fixed seconds of a run besides its rounds: the simulator's start and end, a POC's start and removal
# (docs/benchmarks.md, issue 32)
bench-fixed: install
	$(PY) benchmarks/fixed_costs.py --repeats 3 --out runs/bench-fixed

# Each seed method with its --preset paper against its main baseline on the MedMNIST sets, 3 seeds (issue 28), sized
# for <= 40 GPU-minutes per method; without CUDA it refuses with an estimate measured here (BENCH_PAPER_ARGS=--dry-run
# prints the plan and the estimate, --allow-cpu runs anyway). Tables land in runs/bench-paper/.
BENCH_PAPER_ARGS ?=
bench-paper: install
	$(PY) benchmarks/paper.py --out runs/bench-paper $(BENCH_PAPER_ARGS)

# The lease-sized paper pack (issue 51): every seed method against its paper's baselines at MedMNIST's own 28 px, the
# papers' rounds (cuts stated in the plan), all arms side by side on one GPU within a 10-minute lease; a stopped pack
# resumes from its saves; rows append to benchmarks/results/paper_lease.md. BENCH_PAPER_LEASE_ARGS=--dry-run prints the
# plan, the steps timed here and the H100 estimate. On a lent GPU machine: benchmarks/paper_lease_on_gpu.sh.
BENCH_PAPER_LEASE_ARGS ?=
bench-paper-lease: install
	$(PY) benchmarks/paper_lease.py --out runs/bench-paper-lease $(BENCH_PAPER_LEASE_ARGS)

# make test: the fast tests and a smoke set (tests marked smoke: one FLARE simulator run per control pattern, one POC;
# every registered method through the in-process loop with the job's plan and aggregation), within 10 minutes on a
# fresh 2-core clone, install included. make test-heavy: the tests marked heavy (every method in FLARE's simulator,
# the POCs with encryption and faults, the rehearsals, the examples, the runnable docs). tests/conftest.py refuses a
# slow test that is neither. Every process a test starts starts as it does for a user.
# pytest exit code 5 means "no tests collected": that must not pass as green. TEST_WORKERS pytest-xdist workers:
# 4 on the 2-core CI machine, where fewer leave CPU idle while FLARE's processes start and poll; tests/conftest.py
# decides which tests share a worker (all POC tests one, as POCs on one machine take turns).
# OMP_NUM_THREADS=1: one torch thread per worker and per FLARE process it starts (sites already use one), so the
# workers do not spin twice as many threads as there are cores.
# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it, every test process (pytest's workers, FLARE's
# processes) compiled medflare's and the tests' sources again (pytest's collection: 22 against 16.5 CPU-s).
TEST_WORKERS ?= 4
PYTEST_RUN = OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q --timeout=900 --durations=15 -n $(TEST_WORKERS)
test: install
	$(PYTEST_RUN) -m "not heavy"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-heavy: install
	$(PYTEST_RUN) -m heavy; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-heavy: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# ruff with the rules of pyproject.toml's [tool.ruff.lint] (pyflakes, bugbear, import order, docstrings of the
# package's public modules, classes and functions); .ci/run runs it first. `ruff check --fix .` sorts imports.
lint: install
	$(VENV)/bin/ruff check .

# Every method's invariant ledger (methods/<name>/ledger.toml): each mutant applied in a scratch copy, its tests run,
# a killed/survived table printed and written to runs/mutants/mutants.md; fails when one survives.
mutants: install
	$(PY) tools/mutants.py

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf runs .pytest_cache

# ----- deployment (issue 4): generated artifacts, provisioning, POC, the site wheel -------------------------
.PHONY: catalog apps templates policies privacy-doc deploy-artifacts regenerate provision poc-demo wheel site-wheel rehearse rehearse-faults \
	bench-link
PROJECT ?= provisioning/project.yml
PROVISION_WS ?= runs/provision
POC_METHOD ?= fedavg

# apps/<method>/: the ready-to-submit (pre-installed) job of every registered method; tests fail when stale.
apps: install
	$(PY) -m medflare.console.deploy.apps

# job_templates/<method>/: one `nvflare job create` template per method, from the same builders.
templates: install
	$(PY) tools/job_templates.py

# provisioning/site_local/: the reviewed site-local policy files (authorization, privacy, resources).
policies: install
	$(PY) -c "from medflare.console.deploy.policies import write_policy_templates as w; w()"

# docs/privacy.md's per-method table, generated from each method's Payload.
privacy-doc: install
	$(PY) tools/privacy_doc.py

deploy-artifacts: apps templates policies privacy-doc

# custom/medflare/catalog.jsonc: what `medflare methods` and `medflare models` list without importing torch.
catalog: install
	$(PY) -m medflare.catalog

# Everything the method registry feeds, after a method's summary, options or Payload changed (`medflare new-method`
# runs the same commands: medflare/console/new_method.py's REGENERATORS, checked against these targets).
regenerate: catalog deploy-artifacts

# Startup kits for provisioning/project.yml (with site policies) in $(PROVISION_WS).
provision: install
	provisioning/provision.sh -p $(PROJECT) -w $(PROVISION_WS)

# One command: a 2-site POC on loopback, one method's job (BYOC), results in runs/poc-demo, then stop and clean.
poc-demo: install
	PATH="$(abspath $(VENV))/bin:$$PATH" poc/run.sh $(POC_METHOD) --mode byoc -o runs/poc-demo --overwrite --rounds 3 --max-steps 5

# A deployment rehearsed on this machine (issue 29; needs root): provisioned kits, one network namespace per
# participant, the lead's job over a bridge; everything it made is removed afterwards. REHEARSE_ARGS adds options
# (e.g. --hospitals 3 --rate hospital-c=10 --outage hospital-b@round2:30).
REHEARSE_ARGS ?=
rehearse: install
	$(PY) -m medflare.console.cli rehearse -o runs/rehearse --overwrite $(REHEARSE_ARGS)

# The fault matrix (docs/reliability.md): link down mid-round, a hospital killed and restarted, a 10 Mbit/s hospital,
# the server killed and restarted and the job resubmitted with resume_from.
rehearse-faults: install
	$(PY) -m medflare.console.deploy.rehearse faults -o runs/rehearse-faults --overwrite

# Round time of FedAvg with ResNet-18 over hospital links shaped at 1000, 100 and 20 Mbit/s against the floor the
# link sets (issue 29; needs root: one rehearsal per speed). BENCH_LINK_ARGS adds options (e.g. --dtype float16).
BENCH_LINK_ARGS ?=
bench-link: install
	$(PY) benchmarks/link_speed.py --out runs/bench-link $(BENCH_LINK_ARGS)

# The wheel a pre-installed site reviews and installs (pip install dist/medflare-*.whl).
wheel: install
	$(PY) -m pip wheel --no-deps --wheel-dir dist . && rm -rf build

# dist/medflare_site-*.whl: the job package alone (no medflare.console), for sites that pre-install medflare (issue
# 64; packaging/site/pyproject.toml, built in a temporary folder by tools/site_wheel.py).
site-wheel: install
	$(PY) tools/site_wheel.py dist
