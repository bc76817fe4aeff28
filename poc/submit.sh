#!/usr/bin/env bash
# Export a method's job and submit it to the running POC as the project's lead.
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: poc/submit.sh METHOD [--mode byoc|preinstalled] [medflare run options: --data --partition --rounds --set ...]
  Prints the job id; 'poc/wait.sh' and 'poc/download.sh' default to the last submitted job.
Environment: MEDFLARE_POC_ROOT (default runs/poc), MEDFLARE_POC_PORT (default 8002), PYTHON.
USAGE
}
if [[ $# -gt 0 ]] && { [[ "$1" == -h ]] || [[ "$1" == --help ]]; }; then usage; exit 0; fi
source "$(dirname "$0")/_common.sh"
poc submit "$@"
