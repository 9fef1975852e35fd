#!/usr/bin/env bash
# Install gradequiv as a user does and run it: build the wheel, install it (not
# editable, no [test] extra) into a fresh venv, and from a folder outside the
# source tree run `gradequiv check --impl torch` and `gradequiv report`.
#
# This catches what the dev venv hides: a run-time dependency left in an extra,
# a module or data file (report.schema.json) missing from the wheel, an import
# that only works because the source tree is on sys.path.
#
# Usage: ci/wheel-check.sh        (from anywhere; .ci/run calls it)
#   PYTHON=python3.12 ci/wheel-check.sh   to build the venv with another interpreter
#   KEEP=1 ci/wheel-check.sh              to keep the temporary folder for a look
# Touches nothing in the checkout or its .venv: everything happens under a mktemp folder.
# Exit status: 0 when check exits 0 with a passing report.json and report renders it.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gradequiv-wheel.XXXXXX")
if [[ -n "${KEEP:-}" ]]; then
    echo "ci/wheel-check.sh: keeping $tmp" >&2
else
    trap 'rm -rf "$tmp"' EXIT
fi
started=$SECONDS

# Build from a copy of the files git knows (tracked, and untracked but not ignored):
# setuptools builds in-tree (build/, *.egg-info), and a stale build/lib would slip
# deleted modules into the wheel; a copy keeps the checkout untouched as well.
mkdir "$tmp/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' path; do
        # --cached still lists a tracked file deleted in the work tree.
        if [[ -e "$repo/$path" ]]; then printf '%s\0' "$path"; fi
    done \
    | tar -C "$repo" --null -T - -cf - | tar -C "$tmp/src" -xf -

# A fresh venv, as a user's; its pip builds the wheel too (build isolation fetches
# setuptools, so nothing beyond pip is needed here).
"$python" -m venv "$tmp/venv"
venv_python="$tmp/venv/bin/python"
"$venv_python" -m pip install --quiet --upgrade pip
"$venv_python" -m pip wheel --quiet --no-deps --wheel-dir "$tmp/dist" "$tmp/src"
wheels=("$tmp"/dist/gradequiv-*.whl)
if ((${#wheels[@]} != 1)) || [[ ! -f "${wheels[0]}" ]]; then
    echo "ci/wheel-check.sh: expected one gradequiv wheel in $tmp/dist" >&2
    exit 1
fi
wheel=${wheels[0]}
echo "ci/wheel-check.sh: built $(basename "$wheel")" >&2

# The wheel alone: no -e, no [test] extra. The constraints pin the CPU build of torch
# (an unpinned torch pulls a multi-GB CUDA build); everything else comes from the
# wheel's own dependencies, which is what this check is about.
"$venv_python" -m pip install --quiet -c "$repo/ci/constraints.txt" "$wheel"

# Run from an empty folder so that neither the checkout nor its copy is on sys.path,
# and with no PYTHONPATH that could point back at it.
run_dir="$tmp/run"
report_dir="$run_dir/report"
mkdir "$run_dir"
cd "$run_dir"
unset PYTHONPATH
# The package must come from the venv's site-packages, not from a source folder.
"$venv_python" - "$tmp/venv" <<'EOF'
import sys
from pathlib import Path

import gradequiv
import gradequiv.harness
import gradequiv.properties

venv = Path(sys.argv[1]).resolve()
if gradequiv.check is not gradequiv.harness.check:  # the Python API, at the top
    sys.exit("ci/wheel-check.sh: gradequiv.check is not gradequiv.harness.check")
for package in (gradequiv, gradequiv.harness, gradequiv.properties):
    where = Path(package.__file__).resolve()
    if venv not in where.parents:
        sys.exit(f"ci/wheel-check.sh: {package.__name__} imported from {where}, not the venv")
EOF

status=0
"$tmp/venv/bin/gradequiv" check --impl torch --report-dir "$report_dir" || status=$?
if ((status != 0)); then
    echo "ci/wheel-check.sh: gradequiv check exited $status (want 0)" >&2
    exit 1
fi
"$venv_python" - "$report_dir/report.json" <<'EOF'
import json
import sys
from pathlib import Path

path = Path(sys.argv[1])
if not path.is_file():
    sys.exit(f"ci/wheel-check.sh: {path} was not written")
verdict = json.loads(path.read_text(encoding="utf-8")).get("verdict")
if verdict != "pass":
    sys.exit(f"ci/wheel-check.sh: {path} has verdict {verdict!r} (want 'pass')")
print(f"ci/wheel-check.sh: {path.name} verdict {verdict}", file=sys.stderr)
EOF
# Every format renders from the installed package (its schema file, no matplotlib).
"$tmp/venv/bin/gradequiv" report "$report_dir"
for name in report.md report.html junit.xml; do
    if [[ ! -s "$report_dir/$name" ]]; then
        echo "ci/wheel-check.sh: gradequiv report left no $name" >&2
        exit 1
    fi
done
echo "ci/wheel-check.sh: pass in $((SECONDS - started)) s" >&2
