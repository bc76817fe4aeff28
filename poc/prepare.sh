#!/usr/bin/env bash
# Provision a fresh POC (mTLS kits from provisioning/project.yml, site policies installed).
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: poc/prepare.sh [--sites N] [--mode-default byoc|preinstalled] [--site-mode SITE=MODE ...] [--allow-job-data]
  Removes any previous POC in MEDFLARE_POC_ROOT first; refuses if the port is held by another process.
  --allow-job-data: sites accept jobs that bring their own (e.g. synthetic) data, as poc/submit.sh's default
  data is; without it each site reads only its own local/medflare_site.json, like a hospital.
Environment: MEDFLARE_POC_ROOT (default runs/poc), MEDFLARE_POC_PORT (default 8002), PYTHON.
USAGE
}
if [[ $# -gt 0 ]] && { [[ "$1" == -h ]] || [[ "$1" == --help ]]; }; then usage; exit 0; fi
source "$(dirname "$0")/_common.sh"
poc prepare "$@"
