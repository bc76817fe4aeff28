#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md, as run on a lent GPU machine that has its own Python with PyTorch, no
# network, and no medflare environment (one short script: the lease is minutes). What it runs:
#   1. `benchmarks/paper.py --dry-run`: bench-paper's plan with each arm's optimizer step timed on the GPU (full
#      batch under autocast), so the 40-GPU-minute budgets are checked against a real card;
#   2. `benchmarks/peer_flower.py --sides bare flower-deploy`: Flower's deployment engine with its sites on the GPU
#      against the bare loop in the same run (Flower's simulation engine needs Ray, too large to carry there).
# What it needs beside the checkout (both ignored by git, carried to the machine):
#   .gpudata/   the MedMNIST files of ../shared/data/medmnist (../shared does not travel)
#   .whl/flower flwr 1.42 and its dependencies as cp312 wheels (`pip download --no-deps`, versions as in
#               .venv-flower); Flower gets its own venv there, which sees the machine's PyTorch through a .pth
#               line placed after its own packages, so its protobuf 6 wins over the machine's.
# PAPER=0 leaves the plan out. Results go to $OUT (paper.txt, peer.md, peer.json, smi.csv, log.txt).
set -uo pipefail
for need in .gpudata/pneumoniamnist.npz .whl/flower; do
  [ -e "$need" ] || { echo "on_lent_gpu.sh: $need is missing: see the header of this script for what to place there" >&2; exit 2; }
done
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/custom"
date -u; nvidia-smi -L; nproc
python3 -c "import torch, torchvision, timm; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__)"

mkdir -p ../shared/data/medmnist && cp .gpudata/*.npz ../shared/data/medmnist/
DATA="medmnist:$(cd ../shared/data/medmnist && pwd)/pneumoniamnist.npz"

echo "== bench-paper plan, steps timed on the GPU"
start=$SECONDS
[ "${PAPER:-1}" = 1 ] && timeout 240 python3 benchmarks/paper.py --dry-run 2>&1 | tee "$OUT/paper.txt"
echo "paper dry-run: $((SECONDS - start)) s"

echo "== Flower's venv"
python3 -m venv --without-pip /tmp/fv
python3 -m pip --python /tmp/fv/bin/python install -q --no-index --no-deps --no-compile .whl/flower/*.whl || exit 1
python3 -c "import site; print(site.getsitepackages()[0])" > "$(ls -d /tmp/fv/lib/python3*/site-packages)/machine.pth"
/tmp/fv/bin/python -c "import flwr, google.protobuf as p, torch; print('flwr', flwr.__version__, 'protobuf', p.__version__, 'cuda', torch.cuda.is_available())" || exit 1

echo "== peer: bare vs flower-deploy on the GPU"
nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
smi=$!
# PEER_ARGS narrows the run (a rerun of one model); PEER_LIMIT keeps the copy below inside the lease
timeout "${PEER_LIMIT:-420}" python3 benchmarks/peer_flower.py --sides bare flower-deploy --rounds 5 --data "$DATA" \
  --flower-venv /tmp/fv --out /tmp/peer ${PEER_ARGS:---models resnet18 cnn --side-timeout 150}
kill $smi
cp /tmp/peer/results.md "$OUT/peer.md"; cp /tmp/peer/results.json "$OUT/peer.json"
date -u
