#!/usr/bin/env bash
# Download a finished POC job into the usual summary.json / rounds.csv / report.md / plots form.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: poc/download.sh [JOB_ID] [-o OUT_DIR]
  Default folder: runs/poc-<method>-<job>.
Environment: MEDFLARE_POC_ROOT (default runs/poc), MEDFLARE_POC_PORT (default 8002), PYTHON.
USAGE
}
if [[ $# -gt 0 ]] && { [[ "$1" == -h ]] || [[ "$1" == --help ]]; }; then usage; exit 0; fi
source "$(dirname "$0")/_common.sh"
poc download "$@"
