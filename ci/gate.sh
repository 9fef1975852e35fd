#!/usr/bin/env bash
# The CI gate: check an implementation (and, when asked, prove the suite still
# catches every mutant), then render every report format, whatever the verdict.
#
# Usage:
#   ci/gate.sh --impl SPEC [--mutants] [--report-dir DIR] [-- EXTRA CHECK OPTIONS]
# e.g.
#   ci/gate.sh --impl torch
#   ci/gate.sh --impl mypkg.recompute:checkpoint --mutants -- --profile thorough
#
# Writes DIR (default gradequiv-report): report.json, report.md, report.html,
# junit.xml, and mutants.json/mutants.md with --mutants. Where
# $GITHUB_STEP_SUMMARY is set (GitHub Actions), the Markdown summary is
# appended to it.
#
# Exit status: that of `gradequiv check` (0 pass, 1 a property failed, 2 usage
# error, 130 interrupted); 1 if check passed but a mutant survived, or report.json
# is missing, incomplete or not this run's; 2 if the reports could not be rendered.
set -uo pipefail

impl="" mutants=0 dir="gradequiv-report" extra=()
while (($#)); do
    case "$1" in
        --impl) impl="${2:?--impl needs a SPEC}"; shift 2 ;;
        --mutants) mutants=1; shift ;;
        --report-dir) dir="${2:?--report-dir needs a folder}"; shift 2 ;;
        --) shift; extra=("$@"); break ;;
        *) echo "ci/gate.sh: unknown argument '$1'; see the usage at the top of $0" >&2
           exit 2 ;;
    esac
done
if [[ -z "$impl" ]]; then
    echo "ci/gate.sh: --impl SPEC is required (e.g. --impl torch)" >&2
    exit 2
fi
gradequiv=${GRADEQUIV:-gradequiv}

# The run's id: report.json must say this run wrote it, whole, or the gate fails; an
# implementation that ends the process, or a report left by an earlier run, is no pass.
run_id="gate-$(date +%s)-$$-$RANDOM"
GRADEQUIV_RUN_ID="$run_id" "$gradequiv" check --impl "$impl" --report-dir "$dir" "${extra[@]}"
status=$?
if ((mutants)) && ((status == 0 || status == 1)); then
    "$gradequiv" mutants --report-dir "$dir"
    mutants_status=$?
    if ((status == 0 && mutants_status != 0)); then status=1; fi
fi
if [[ -f "$dir/report.json" || -f "$dir/mutants.json" ]]; then
    "$gradequiv" report "$dir" --format all --require-run "$run_id"
    rendered=$?
    if ((rendered == 2)); then status=2; elif ((rendered != 0 && status == 0)); then status=1; fi
elif ((status == 0)); then
    echo "ci/gate.sh: check exited 0 but run $run_id wrote no report.json: not a pass" >&2
    status=1
fi
if [[ -f "$dir/report.md" ]]; then
    if [[ -n "${GITHUB_STEP_SUMMARY:-}" ]]; then
        cat "$dir/report.md" >> "$GITHUB_STEP_SUMMARY"
    fi
fi
echo "ci/gate.sh: exit $status; reports in $dir/" >&2
exit "$status"
