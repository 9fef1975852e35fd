#!/usr/bin/env bash
# The CUDA checks, as one short script for a machine with one NVIDIA GPU
# (about 10 minutes on one GPU, an estimate: not yet run). Installs nothing
# from the network: run it in an environment where gradequiv[test] and a
# CUDA build of torch are installed (pip install -e '.[test]' against a CUDA
# torch wheel).
#
# Usage: ci/gpu-check.sh [OUT_DIR]   (default gpu-check/)
# Prints a summary at the end; exit 0 only if every step did what it must:
#   1. the tests that need CUDA (memory count on CUDA tensors),
#   2. gradequiv check --device cuda for torch and torch-reentrant (exit 0),
#   3. gradequiv mutants --device cuda, the CUDA-only mutant live (exit 0),
#   4. gradequiv profile --device cuda (allocator figures beside the count),
#   5. every report format,
#   6. offload (save_on_cpu): exact, and the bytes leave the GPU (check and profile),
#   7. the compile regime on CUDA (inductor with Triton): one budget, one SAC policy,
#   8. with 2 or more GPUs, DDP and FSDP over NCCL (gradequiv distributed).
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
declare -a summary=()
status=0

step() {  # step NAME EXPECTED_EXIT COMMAND...
    local name=$1 expected=$2 started code
    shift 2
    started=$(date +%s)
    echo "=== $name: $*" >&2
    "$@" > "$out/$name.log" 2>&1
    code=$?
    local verdict="ok"
    if [[ "$code" != "$expected" ]]; then verdict="FAILED (exit $code, expected $expected)"; status=1; fi
    summary+=("$(printf '%-22s %-40s %4ss' "$name" "$verdict" "$(( $(date +%s) - started ))")")
    tail -n 3 "$out/$name.log" >&2
}

python - <<'PY' > "$out/conditions.txt" 2>&1 || { echo "torch does not see a GPU"; cat "$out/conditions.txt"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "count", torch.cuda.device_count())
PY
cat "$out/conditions.txt"

step cuda-tests 0 python -m pytest -q -p no:cacheprovider tests/test_memory.py tests/test_profile.py tests/test_compare.py
step check-torch 0 gradequiv check --impl torch --device cuda --report-dir "$out/torch"
step check-reentrant 0 gradequiv check --impl torch-reentrant --device cuda --report-dir "$out/reentrant"
step check-no-rng 1 gradequiv check --impl torch --impl-kwarg preserve_rng_state=false --device cuda --report-dir "$out/no-rng"
step mutants 0 gradequiv mutants --device cuda --examples 10 --report-dir "$out/torch"
step profile 0 gradequiv profile --impl torch --device cuda --steps 20 --report-dir "$out/torch"
step reports 0 gradequiv report "$out/torch" --format all
step check-offload 0 gradequiv check --impl torch-offload --device cuda --examples 10 --report-dir "$out/offload"
step profile-offload 0 gradequiv profile --impl torch-offload --device cuda --steps 5 --report-dir "$out/offload"
step compile-budget 0 gradequiv check --impl compile-budget:0.5 --device cuda --examples 5 --report-dir "$out/compile-budget"
step compile-sac 0 gradequiv check --impl compile-sac:matmuls --device cuda --examples 5 --report-dir "$out/compile-sac"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if ((gpus >= 2)); then
    step distributed-nccl 0 gradequiv distributed --impl torch --device cuda
else
    summary+=("$(printf '%-22s %s' distributed-nccl "skipped: NCCL needs 2 GPUs, this machine has $gpus")")
fi

echo
echo "gpu-check summary ($(cat "$out/conditions.txt"))"
printf '%s\n' "${summary[@]}"
grep -h "^\*\*Mutation score" "$out/torch/mutants.md" 2>/dev/null || true
grep -A12 "^| granularity" "$out/torch/profile.md" 2>/dev/null | head -20 || true
exit "$status"
