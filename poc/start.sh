#!/usr/bin/env bash
# Start the POC server and sites; returns when they are ready.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: poc/start.sh [--exclude PARTICIPANT ...] [--timeout S]
  Starts every site unless excluded.
Environment: MEDFLARE_POC_ROOT (default runs/poc), MEDFLARE_POC_PORT (default 8002), PYTHON.
USAGE
}
if [[ $# -gt 0 ]] && { [[ "$1" == -h ]] || [[ "$1" == --help ]]; }; then usage; exit 0; fi
source "$(dirname "$0")/_common.sh"
poc start "$@"
