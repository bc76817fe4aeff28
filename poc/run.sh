#!/usr/bin/env bash
# All in one: prepare, start, submit, wait, download, stop and clean (nothing left running).
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: poc/run.sh METHOD [--mode byoc|preinstalled] [-o OUT_DIR] [medflare run options]
  Example: poc/run.sh fedavg --mode preinstalled --rounds 3 --max-steps 5 -o runs/poc-fedavg
Environment: MEDFLARE_POC_ROOT (default runs/poc), MEDFLARE_POC_PORT (default 8002), PYTHON.
USAGE
}
if [[ $# -gt 0 ]] && { [[ "$1" == -h ]] || [[ "$1" == --help ]]; }; then usage; exit 0; fi
source "$(dirname "$0")/_common.sh"
poc run "$@"
