"""The cause benchmark: every mutant of the fault library on the case that exposes it (the
cheapest kind from tests/test_fault_library.py, a named case otherwise), with the headline
cause its minimal failure must get. docs/causes.md gives the same table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_diagnosis import diagnosed
from test_fault_library import CASES

from gradequiv.harness import find_case
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.faults import MUTANTS
from gradequiv.harness.reports.diagnosis import CAUSES

#: mutant -> (case kind or named case, headline cause)
EXPECTED = {
    "no-rng-restore": ("1L-layer-dropout", "rng-not-restored"),
    "rng-lost-on-first-call": ("1L-layer-dropout", "rng-not-restored"),
    "rng-captured-late": ("1L-layer-dropout", "rng-not-restored"),
    "reseeded": ("1L-layer-dropout", "rng-not-restored"),
    "caller-stream-moved": ("2L-layer-manual-attn", "rng-stream-moved"),
    "caller-stream-moved-once": ("2L-layer-manual-attn", "rng-stream-moved"),
    "dropout-off": ("1L-layer-dropout", "dropout-skipped"),
    "autocast-lost": ("2L-layer-bf16-dropout", "autocast-lost"),
    "rerun-other-attention-kernel": ("2L-layer-bf16-nodropout", "kernel-changed"),
    "kwargs-dropped": ("1L-layer-dropout", "inputs-lost"),
    "input-grads-dropped": ("1L-layer-dropout", "input-grads-dropped"),
    "inputs-detached": ("1L-layer-dropout", "input-grads-dropped"),
    "stale-recompute": ("1L-layer-dropout", "later-step"),
    "no-op": ("1L-layer-dropout", "no-memory-saved"),
    "gradient-skew": ("1L-layer-dropout", "input-grads-dropped"),
    "buffers-updated-twice": ("batchnorm-layer", "buffers-updated-twice"),
    "crash-in-backward": ("1L-layer-dropout", "raised"),
    "autocast-default-dtype": ("fp16-autocast", "autocast-lost"),
    "autocast-forced-on": ("plain", "autocast-lost"),
    "grad-via-backward": ("autograd-grad", "grad-touched"),
    "accumulated-grad-overwritten": ("accumulate", "accumulation-lost"),
    "kwarg-tensors-detached": ("x0-keyword", "input-grads-dropped"),
    "tuple-tail-no-grad": ("aux-loss", "input-grads-dropped"),
    "state-per-module-slot": ("repeats-dropout", "rng-not-restored"),
    "state-queue-without-backward": ("inference-dropout", "inference"),
    "recomputed-kept": ("plain", "leak"),
    "saved-inputs-kept": ("plain", "leak"),
    "large-boundary-compressed": ("large", "inputs-lost"),
    "group-layers-unchained": ("group", "forward-changed"),
    "bn-stats-in-recompute-only": ("batchnorm-inference", "buffers-missed"),
    "grads-without-graph": ("2L-layer-create-graph-manual-attn", "second-order-lost"),
    "stash-kept-after-warmup": ("1L-layer-dropout", "leak"),
    "grad-mode-forced-on": ("2L-layer-frozen-first-layer", "grad-mode-ignored"),
    "nested-tensors-no-grad": ("nested", "input-captured"),
    "rng-devices-from-positional": ("nested-dropout", "rng-not-restored"),
    "autocast-device-from-first-arg": ("nested-bf16-autocast", "autocast-lost"),
    "matmul-outputs-cached": ("inplace-manual", "saved-output-changed"),
    "hooks-skipped-in-recompute": ("hooks", "hooks-skipped"),
    "hooks-run-twice": ("hooks", "forward-changed"),
    "outside-params-no-grad": ("outside", "input-grads-dropped"),
    "outside-params-grad-doubled": ("outside", "param-grads-wrong"),
    "recomputed-held-to-backward-end": ("plain", "recomputed-held"),
    "padding-zeroed": ("2L-layer-manual-attn", "forward-changed"),
    "autocast-latched": ("2L-layer-bf16-fp32-last-layer", "autocast-lost"),
    "autocast-off-not-restored": ("2L-layer-fp32-backward-autocast-dropout",
                                  "autocast-from-backward"),
    "boundary-per-module-slot": ("2L-layer-gpipe-dropout", "in-flight-state"),
    "state-per-module-stack": ("2L-layer-gpipe-dropout", "in-flight-state"),
    "host-pool-of-three": ("2L-layer-1f1b-dropout", "in-flight-state"),
    "input-leaves-grad-kept": ("2L-layer-two-losses-dropout", "second-pass"),
    "rng-state-consumed-by-backward": ("2L-layer-two-losses-dropout", "second-pass"),
    "saved-inputs-freed-after-backward": ("2L-layer-two-losses-dropout", "second-pass"),
    "trainable-params-cached": ("2L-layer-changing-trainable-dropout", "trainable-misread"),
    "frozen-segment-no-grad": ("3L-layer-frozen-layer-dropout", "trainable-misread"),
    # as the first case of a fresh process (below); a suite run says process-state first
    "trainable-cached-per-process": ("3L-layer-frozen-layer-dropout", "input-grads-dropped"),
    "none-outputs-dropped": ("2L-layer-dict-outputs-aux-dropout", "output-structure"),
}


def test_every_mutant_but_the_cuda_ones_is_in_the_table() -> None:
    assert set(EXPECTED) == {m.name for m in MUTANTS if not m.cuda_only}
    assert {cause for _, cause in EXPECTED.values()} <= set(CAUSES)


def test_docs_give_the_same_table() -> None:
    text = (Path(__file__).parents[1] / "docs" / "causes.md").read_text()
    rows = dict(_row(line) for line in text.splitlines() if line.startswith("| `"))
    assert rows == {name: (case, cause) for name, (case, cause) in EXPECTED.items()}


def _row(line: str) -> tuple[str, tuple[str, str]]:
    name, case, cause = (cell.strip().strip("`") for cell in line.strip("|").split("|")[:3])
    return name, (case, cause)


@pytest.mark.mutants
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_mutant_gets_its_cause(name: str) -> None:
    case_name, cause = EXPECTED[name]
    case = CASES[case_name] if case_name in CASES else find_case(case_name)
    mutant = next(m for m in MUTANTS if m.name == name)
    if name == "trainable-cached-per-process":  # this process as a fresh one sees it
        from gradequiv.harness.implementations import faults

        faults._PROCESS_TRAINABLE.clear()
    found, sentence, _ = diagnosed(Implementation(name, mutant.impl), case)
    assert found == cause, sentence
