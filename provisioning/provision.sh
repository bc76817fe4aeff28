#!/usr/bin/env bash
# Provision the consortium: startup kits for every participant of project.yml, with medflare's site policies
# (authorization.json, privacy.json, resources.json) already in each site's local/ folder.
set -euo pipefail

usage() {
  cat <<USAGE
usage: provisioning/provision.sh -p PROJECT_YML -w WORKSPACE [--mode byoc|preinstalled]
                                 [--site-mode SITE=MODE ...] [--gpus SITE=N ...]

  -p PROJECT_YML   consortium description (default: provisioning/project.yml)
  -w WORKSPACE     where kits are written: WORKSPACE/<project>/prod_NN/<participant>/ (keep it private);
                   nothing is written outside it: the project's and every participant's name must be one plain
                   folder name (no '/', not starting with '.' or '-'), and a link out of WORKSPACE is refused
  --mode           site mode for every site: byoc (accepts code-carrying and pre-installed jobs, default)
                   or preinstalled (runs only the medflare wheel the site installed; BYOC refused)
  --site-mode      per-site mode, e.g. --site-mode hospital-b=preinstalled
  --gpus           GPUs a site offers to jobs, e.g. --gpus hospital-a=2

The project folder is made private (0700) and WORKSPACE/<project>/state/cert.json (the root CA key and every
participant's key) 0600: move that file to offline storage afterwards (docs/deploy.md, "Where the secrets are").

Needs the medflare environment (python with medflare and nvflare==2.9.0). Set PYTHON to choose it.
USAGE
}

PYTHON="${PYTHON:-python}"
project="provisioning/project.yml"
workspace=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -p) project="$2"; shift 2 ;;
    -w) workspace="$2"; shift 2 ;;
    --mode|--site-mode|--gpus) args+=("$1" "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "provision.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -n "$workspace" ]] || { echo "provision.sh: -w WORKSPACE is required" >&2; usage >&2; exit 2; }
[[ -f "$project" ]] || { echo "provision.sh: no project file '$project'" >&2; exit 2; }
"$PYTHON" -c "import medflare, nvflare" 2>/dev/null || {
  echo "provision.sh: '$PYTHON' cannot import medflare and nvflare; activate the medflare venv or set PYTHON" >&2
  exit 2
}
exec "$PYTHON" -m medflare.console.deploy.provision -p "$project" -w "$workspace" "${args[@]}"
