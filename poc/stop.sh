#!/usr/bin/env bash
# Stop every process of the POC.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: poc/stop.sh 
  Safe when nothing is running.
Environment: MEDFLARE_POC_ROOT (default runs/poc), MEDFLARE_POC_PORT (default 8002), PYTHON.
USAGE
}
if [[ $# -gt 0 ]] && { [[ "$1" == -h ]] || [[ "$1" == --help ]]; }; then usage; exit 0; fi
source "$(dirname "$0")/_common.sh"
poc stop "$@"
