#!/usr/bin/env bash
# The README's set-up as a newcomer runs it: each command of its Quick start, word for word
# from the README's text, in the repository root, before anything else is installed. Fails
# on the first that fails (a test that needs an extra the first command does not install
# fails here, in the second).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t commands < <(python3 ci/readme_commands.py)
if [ "${#commands[@]}" -ne 2 ]; then
    echo "ci/readme-setup.sh: the README's Quick start holds ${#commands[@]} commands, not 2" >&2
    exit 1
fi
for command in "${commands[@]}"; do
    echo "+ $command"
    bash -c "$command"
done
