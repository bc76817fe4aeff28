#!/usr/bin/env bash
# One fresh-clone CI run as CI does it (issue 47): clone this repository's committed main into DIR/main, copy
# ../shared beside it, run `CI=true bash .ci/run` with no standard input, and write every line of its output prefixed
# with the seconds since the start to DIR.log, then "rc=<exit status> total=<seconds>". Usage:
#   tools/fresh_clone_ci.sh /tmp/ci1            # e.g. three in a row; one beside tools/cpu_neighbour.py
set -uo pipefail
dir=${1:?usage: tools/fresh_clone_ci.sh DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$dir" && mkdir -p "$dir"
git clone -q "$repo" "$dir/main"
cp -r "$repo/../shared" "$dir/shared"
cd "$dir/main" || exit 1
start=$(date +%s)
CI=true bash .ci/run < /dev/null 2>&1 | while IFS= read -r line; do echo "$(( $(date +%s) - start )) $line"; done > "$dir.log"
echo "rc=${PIPESTATUS[0]} total=$(( $(date +%s) - start ))" >> "$dir.log"
