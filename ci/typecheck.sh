#!/usr/bin/env bash
# mypy --strict over the gradequiv package.
#
# The package maps folders to import names through setuptools package-dir
# (harness/ -> gradequiv.harness, models/ -> gradequiv.models, properties/ ->
# gradequiv.properties), which mypy cannot follow. So this builds a throwaway
# tree under a mktemp folder,
#
#     $tmp/gradequiv/harness    -> <repo>/harness
#     $tmp/gradequiv/models     -> <repo>/models
#     $tmp/gradequiv/properties -> <repo>/properties
#
# (gradequiv itself a namespace package, as installed) and runs mypy there.
# mypy names files by that tree, gradequiv/harness/engine/case.py and so on;
# the output is rewritten so that every path is relative to the repository
# root (gradequiv/harness/engine/case.py -> harness/engine/case.py, at any
# depth of sub-package), the path to open.
#
# Usage: ci/typecheck.sh [extra mypy arguments...]
#   e.g. ci/typecheck.sh --no-incremental, ci/typecheck.sh --warn-unreachable
# The exit status is mypy's: non-zero on type errors.
# The cache lives under ${XDG_CACHE_HOME:-~/.cache}/gradequiv-mypy (checking
# torch is slow cold); set MYPY_CACHE_DIR to put it elsewhere.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gradequiv-typecheck.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

mkdir "$tmp/gradequiv"
ln -s "$repo/gradequiv/__init__.py" "$tmp/gradequiv/__init__.py"
for pkg in harness models properties; do
    ln -s "$repo/$pkg" "$tmp/gradequiv/$pkg"
done

export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/gradequiv-mypy}"

cd "$tmp"
# pipefail: the status is mypy's, not sed's.
mypy --strict --namespace-packages --explicit-package-bases \
    --python-version 3.11 --hide-error-context --show-error-codes \
    "$@" -p gradequiv 2>&1 \
    | sed -E "s#(^|[^[:alnum:]_./-])gradequiv/(harness|models|properties)/#\1\2/#g"
