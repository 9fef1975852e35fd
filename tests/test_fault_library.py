"""The fault library's newer mutants: each caught by the cheapest case kind that exposes it.

For each mutant: the case it fails and the property that catches it, and a
case it passes (for the mode-specific faults the plain backward case), which
shows that the case kind, not chance, is what catches it. The correct base
and torch's own checkpoint pass every case used here, so a failure is the
fault's, not the case's.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest

from gradequiv.harness import find_case, verify
from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.verify import Verdict
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.faults import MUTANTS, reference_checkpoint, switches
from gradequiv.models import BatchConfig, BatchNormConfig, TransformerConfig, parse_granularity

_SMALL = TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=16)
_DROPOUT = replace(_SMALL, attn_dropout=0.1, mlp_dropout=0.1, resid_dropout=0.1)
_BATCH = BatchConfig(4, 8)
_BATCHNORM = BatchNormConfig(n_layer=2, width=16, dropout=0.1)

#: The case kinds, cheapest that expose each fault; "large" is the one whose segment
#: inputs (16 x 72 x 64 = 73728 elements) exceed the 64K that large-boundary-compressed
#: compresses above.
CASES: dict[str, Case] = {
    "plain": Case(model=_SMALL, batch=_BATCH),
    "dropout": Case(model=_DROPOUT, batch=_BATCH),
    "fp16-autocast": Case(model=_SMALL, batch=_BATCH, dtype="fp16-autocast"),
    "bf16-autocast": Case(model=_SMALL, batch=_BATCH, dtype="bf16-autocast"),
    "autograd-grad": Case(model=_SMALL, batch=_BATCH, grad_mode="autograd-grad"),
    "accumulate": Case(model=_SMALL, batch=_BATCH, grad_mode="accumulate"),
    "x0-keyword": Case(model=replace(_SMALL, x0_keyword=True), batch=_BATCH),
    "aux-loss": Case(model=replace(_SMALL, aux_loss=True), batch=_BATCH),
    "repeats-dropout": Case(model=replace(_DROPOUT, layer_repeats=2), batch=_BATCH),
    "inference-dropout": Case(model=_DROPOUT, batch=_BATCH, inference=True),
    "group": Case(model=_SMALL, batch=_BATCH, granularity=parse_granularity("group:2")),
    "large": Case(model=TransformerConfig(n_layer=1, n_embd=64, n_head=2, max_seq_len=72),
                  batch=BatchConfig(16, 72)),
    "manual-dropout": Case(model=replace(_DROPOUT, attention="manual"), batch=_BATCH),
    "nested": Case(model=replace(_SMALL, nested_inputs=True), batch=_BATCH),
    "nested-dropout": Case(model=replace(_DROPOUT, nested_inputs=True), batch=_BATCH),
    "nested-bf16-autocast": Case(model=replace(_SMALL, nested_inputs=True), batch=_BATCH,
                                 dtype="bf16-autocast"),
    "inplace-manual": Case(model=replace(_SMALL, inplace_ops=True, attention="manual"),
                           batch=_BATCH),
    "hooks": Case(model=replace(_SMALL, value_hooks=True), batch=_BATCH),
    "hooks-attention": Case(model=replace(_SMALL, value_hooks=True), batch=_BATCH,
                            granularity=parse_granularity("attention")),
    "outside": Case(model=replace(_SMALL, outside_params=True), batch=_BATCH),
    "batchnorm": Case(model=_BATCHNORM, batch=BatchConfig(4, 1)),
    "batchnorm-inference": Case(model=_BATCHNORM, batch=BatchConfig(4, 1), inference=True),
    "batchnorm-inplace": Case(model=replace(_BATCHNORM, inplace_ops=True), batch=BatchConfig(4, 1)),
}

#: mutant -> (the case that catches it, the property that does, a case it passes).
EXPECTED: dict[str, tuple[str, str, str]] = {
    "autocast-default-dtype": ("fp16-autocast", "gradients", "bf16-autocast"),
    "autocast-forced-on": ("plain", "gradients", "bf16-autocast"),
    "grad-via-backward": ("autograd-grad", "gradients", "plain"),
    "accumulated-grad-overwritten": ("accumulate", "gradients", "plain"),
    "kwarg-tensors-detached": ("x0-keyword", "gradients", "plain"),
    "tuple-tail-no-grad": ("aux-loss", "gradients", "plain"),
    "state-per-module-slot": ("repeats-dropout", "gradients", "dropout"),
    "state-queue-without-backward": ("inference-dropout", "gradients", "dropout"),
    "recomputed-kept": ("plain", "recompute", "dropout"),
    "saved-inputs-kept": ("plain", "recompute", "dropout"),
    "large-boundary-compressed": ("large", "gradients", "plain"),
    "group-layers-unchained": ("group", "outputs", "plain"),
    "bn-stats-in-recompute-only": ("batchnorm-inference", "buffers", "batchnorm"),
    "nested-tensors-no-grad": ("nested", "gradients", "plain"),
    "rng-devices-from-positional": ("nested-dropout", "gradients", "dropout"),
    "autocast-device-from-first-arg": ("nested-bf16-autocast", "gradients", "bf16-autocast"),
    "matmul-outputs-cached": ("inplace-manual", "gradients", "manual-dropout"),
    "hooks-skipped-in-recompute": ("hooks", "gradients", "plain"),
    "hooks-run-twice": ("hooks", "outputs", "plain"),
    "outside-params-no-grad": ("outside", "gradients", "plain"),
    "outside-params-grad-doubled": ("outside", "gradients", "plain"),
    # one segment re-run (a group of both layers): nothing earlier to carry
    "recomputed-held-to-backward-end": ("plain", "recompute", "group"),
    # The training-loop families, on the spread's named cases: each passes the plain
    # manual-attention case, where every forward is followed by its one backward
    "autocast-off-not-restored": ("2L-layer-fp32-backward-autocast-dropout", "gradients",
                                  "2L-layer-manual-attn"),
    "boundary-per-module-slot": ("2L-layer-gpipe-dropout", "gradients", "2L-layer-manual-attn"),
    "state-per-module-stack": ("2L-layer-gpipe-dropout", "gradients", "2L-layer-manual-attn"),
    "host-pool-of-three": ("2L-layer-1f1b-dropout", "gradients", "2L-layer-manual-attn"),
    "input-leaves-grad-kept": ("2L-layer-two-losses-dropout", "gradients",
                               "2L-layer-manual-attn"),
    "rng-state-consumed-by-backward": ("2L-layer-two-losses-dropout", "gradients",
                                       "2L-layer-manual-attn"),
    "saved-inputs-freed-after-backward": ("2L-layer-two-losses-dropout", "gradients",
                                          "2L-layer-manual-attn"),
    "trainable-params-cached": ("2L-layer-changing-trainable-dropout", "trajectory",
                                "2L-layer-manual-attn"),
    "frozen-segment-no-grad": ("3L-layer-frozen-layer-dropout", "gradients",
                               "2L-layer-manual-attn"),
}
#: Mutants of a family for which no public issue or pull request was found (source "").
_NO_PUBLIC_SOURCE = {"autocast-off-not-restored", "boundary-per-module-slot",
                     "state-per-module-stack", "rng-state-consumed-by-backward"}
#: The segments that are no plain positional layer call: torch's reentrant checkpoint (its
#: nested tensors passed positionally by the built-in) passes them too.
_SEGMENT_KINDS = ("nested", "nested-dropout", "nested-bf16-autocast", "inplace-manual", "hooks",
                  "hooks-attention", "outside")
# The leak mutants fail every case; their "passes" entry is unused.
_CAUGHT_EVERYWHERE = {"recomputed-kept", "saved-inputs-kept"}

_BY_NAME = {m.name: m for m in MUTANTS}
#: torch's checkpoint updates BatchNorm statistics twice (pytorch#96136): not a case for it.
_TORCH_CASES = [name for name in CASES if not name.startswith("batchnorm")]


@cache
def _verdict(impl_name: str, case_name: str) -> Verdict:
    """Cached: several tests read the same verdict (the base's, a mutant's pass case)."""
    if impl_name in ("torch", "torch-reentrant"):
        return verify(impl_name, CASES[case_name])
    target = reference_checkpoint if impl_name == "reference" else _BY_NAME[impl_name].impl
    case = CASES[case_name] if case_name in CASES else find_case(case_name)
    return verify(Implementation(impl_name, target), case)


def test_each_new_switch_has_one_mutant_with_a_source() -> None:
    """A new switch without a mutant, or a mutant without its issue, cannot be checked."""
    assert set(EXPECTED) <= set(_BY_NAME)
    for name in EXPECTED:
        mutant = _BY_NAME[name]
        flipped = [s for s in switches() if getattr(mutant.faults, s)]
        assert flipped == [name.replace("-", "_")]
        assert mutant.source.startswith("https://github.com/") or (
            name in _NO_PUBLIC_SOURCE and mutant.source == ""), name
    assert all(isinstance(m.source, str) for m in MUTANTS)


@pytest.mark.parametrize("case_name", list(CASES))
def test_the_base_passes_every_case_kind(case_name: str) -> None:
    verdict = _verdict("reference", case_name)
    assert verdict.passed, verdict.first_failure


@pytest.mark.parametrize("case_name", _TORCH_CASES)
def test_torch_passes_every_transformer_case_kind(case_name: str) -> None:
    verdict = _verdict("torch", case_name)
    assert verdict.passed, verdict.first_failure


@pytest.mark.parametrize("case_name", _SEGMENT_KINDS)
def test_torch_reentrant_passes_the_segment_kinds(case_name: str) -> None:
    verdict = _verdict("torch-reentrant", case_name)
    assert verdict.passed, verdict.first_failure


def test_the_segment_kind_mutants_name_what_they_miss() -> None:
    """Missing gradients are named by the tensor that lacks one: a parameter read from
    outside the segment, a hook's parameter, the embedding behind a nested tensor."""
    assert "grad of mlp_gates" in _verdict("outside-params-no-grad", "outside").first_failure
    skipped = _verdict("hooks-skipped-in-recompute", "hooks").first_failure
    assert "grad of blocks.0.steering" in skipped and "exists only on the full-storage" in skipped
    # A segment's pre-hook skipped in the recompute (attention only): its values are wrong
    assert not _verdict("hooks-skipped-in-recompute", "hooks-attention").passed
    assert "wpe.weight" in _verdict("nested-tensors-no-grad", "nested").first_failure


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_new_mutant_is_caught_by_its_case(name: str) -> None:
    case_name, prop, _ = EXPECTED[name]
    verdict = _verdict(name, case_name)
    assert not verdict.passed, f"{name} survived {case_name}"
    assert verdict.error is None, verdict.first_failure  # silent: no crash
    assert verdict.first_failure.startswith(f"{prop}:"), verdict.first_failure


@pytest.mark.parametrize("name", [n for n in EXPECTED if n not in _CAUGHT_EVERYWHERE])
def test_each_new_mutant_passes_without_its_case_kind(name: str) -> None:
    """Without the mode, knob or size that exposes it, the fault is invisible."""
    _, _, passing = EXPECTED[name]
    verdict = _verdict(name, passing)
    assert verdict.passed, f"{name} on {passing}: {verdict.first_failure}"


def test_the_grad_via_backward_fault_is_named_as_touching_grad() -> None:
    """The autograd-grad case catches it by the .grad it writes, not by a value."""
    assert "changed .grad" in _verdict("grad-via-backward", "autograd-grad").first_failure


def test_the_leak_mutants_are_caught_by_the_leak_check() -> None:
    for name in _CAUGHT_EVERYWHERE:
        assert "still alive after its backward" in _verdict(name, "plain").first_failure
