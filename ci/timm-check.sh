#!/usr/bin/env bash
# The timm route's tests (tests/test_timm_route.py) in a venv of their own: timm needs
# torchvision, which PyPI builds for PyPI's torch (a CUDA build, several GB, that runs on
# the CPU), not for the CPU build the main venv pins. gradequiv's torch range admits both.
#
# Usage: ci/timm-check.sh        (from anywhere; .ci/run calls it)
#   VENV=path ci/timm-check.sh   to keep the venv somewhere (default: a mktemp folder,
#                                removed at the end)
# Exit status: pytest's.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${VENV:-}" ]]; then
    venv=$VENV
else
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/gradequiv-timm.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    venv=$tmp/venv
fi
started=$SECONDS
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet -c "$repo/ci/constraints-timm.txt" torch torchvision timm
"$venv/bin/pip" install --quiet -c "$repo/ci/constraints-timm.txt" -e "$repo[test,timm]"
echo "ci/timm-check.sh: venv ready in $((SECONDS - started)) s" >&2
cd "$repo"
"$venv/bin/python" -m pytest -n 2 tests/test_timm_route.py
