#!/usr/bin/env bash
# Wait for a POC job to finish; exit 0 only if it completed.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: poc/wait.sh [JOB_ID] [--timeout S]
  Prints the final status (FINISHED:COMPLETED, FINISHED:FAILED_TO_RUN, ...).
Environment: MEDFLARE_POC_ROOT (default runs/poc), MEDFLARE_POC_PORT (default 8002), PYTHON.
USAGE
}
if [[ $# -gt 0 ]] && { [[ "$1" == -h ]] || [[ "$1" == --help ]]; }; then usage; exit 0; fi
source "$(dirname "$0")/_common.sh"
poc wait "$@"
