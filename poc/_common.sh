# Sourced by the poc/*.sh scripts: pick the python that has medflare, fail clearly otherwise.
# MEDFLARE_POC_ROOT (default runs/poc) holds the POC's own HOME and workspace; MEDFLARE_POC_PORT (default 8002).
PYTHON="${PYTHON:-python}"
if ! "$PYTHON" -c "import medflare, nvflare" 2>/dev/null; then
  echo "$(basename "$0"): '$PYTHON' cannot import medflare and nvflare; activate .venv or set PYTHON" >&2
  exit 2
fi
poc() { exec "$PYTHON" -m medflare.console.deploy.poc "$@"; }
