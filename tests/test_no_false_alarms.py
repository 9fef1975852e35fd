"""Correct code from real libraries and users passes: a pool allocated on the first call, a
library's module-level tensors, a user's selective policy without a marker. The memory
faults beside them (recomputed outputs kept, saved inputs kept, a stash kept from step 2
on) still fail ``recompute`` with the leak named."""

from __future__ import annotations

import correct_impls
import pytest
import torch

from gradequiv.harness import Case, find_case, resolve, verify
from gradequiv.harness.engine.localise import localise
from gradequiv.harness.engine.runner import PathRun, StepRecord
from gradequiv.harness.engine.verify import PropertyResult, _check_freed
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.faults import MUTANTS
from gradequiv.models import BatchConfig, TransformerConfig, parse_granularity

#: a layer segment, an attention-only one (where saving matmuls keeps the most), dropout on
CASES = ["2L-layer-manual-attn", "2L-attention-sdpa-dropout", "2L-group2-aux-shared-x0kw-dropout"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("spec", ["pooled_checkpoint", "lazy_constants_checkpoint"])
def test_an_allocation_on_the_first_call_is_no_leak(spec: str, name: str) -> None:
    correct_impls.reset()  # this case is the process's first call of the implementation
    verdict = verify(f"correct_impls:{spec}", find_case(name))
    assert verdict.passed, verdict.first_failure
    recompute = verdict.properties[-1]
    assert "fewer bytes were held" in recompute.summary


def test_the_pool_is_not_counted_as_held_by_the_segments() -> None:
    case = find_case("2L-layer-manual-attn")
    correct_impls.reset()
    pooled = verify("correct_impls:pooled_checkpoint", case)
    plain = verify("torch", case)
    assert pooled.held_bytes == plain.held_bytes
    assert pooled.held_bytes["recompute"] < correct_impls.POOL_ELEMENTS * 4


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("spec", ["user_selective_checkpoint", "user_matmul_policy_checkpoint",
                                  "copying_matmul_store"])
def test_a_users_selective_policy_passes_without_a_marker(spec: str, name: str) -> None:
    verdict = verify(f"correct_impls:{spec}", find_case(name))
    assert verdict.passed, verdict.first_failure


def test_a_store_of_copies_passes_where_in_place_ops_write_into_its_outputs() -> None:
    """Where torch's SAC refuses (an in-place op on a saved output), a store that saved
    copies is right: no fault, no false alarm."""
    verdict = verify("correct_impls:copying_matmul_store", find_case(INPLACE))
    assert verdict.passed and verdict.error is None, verdict.first_failure
    assert all(p.passed is not None for p in verdict.properties if p.name != "inference")


#: where saving every matmul output holds more than full storage: a tiny attention segment
#: (the minimal case a user's policy shrank to when it was read as a fault)
TINY_ATTENTION = Case(model=TransformerConfig(n_layer=1, n_embd=4, n_head=1,
                                              attention="manual"),
                      batch=BatchConfig(1, 1), granularity=parse_granularity("attention"))


def test_a_policy_that_holds_more_is_reported_by_what_re_ran() -> None:
    verdict = verify("correct_impls:user_matmul_policy_checkpoint", TINY_ATTENTION)
    recompute = verdict.properties[-1]
    assert recompute.passed, recompute.summary
    assert "selective recompute held" in recompute.summary
    assert "re-run skipped 2 of the forward's ops" in recompute.summary


def test_as_many_bytes_after_a_full_re_run_still_fail() -> None:
    """Only a re-run that left out some of the forward's ops is a selective policy: one that
    re-ran every op and held as much as full storage freed nothing."""
    t = torch.zeros(1)

    def run(held: int, back: int) -> PathRun:
        step = StepRecord(t, t, {}, {}, {}, {}, held_bytes=held,
                          uses={"blocks.0": [11, back]})
        return PathRun(steps=[step, step], held_bytes=held)

    full = run(100, 0)
    everything = PropertyResult("recompute", True)
    _check_freed(full, run(100, 11), everything)
    assert everything.failures and "nothing was freed" in everything.failures[0]
    some = PropertyResult("recompute", True)
    _check_freed(full, run(100, 7), some)
    assert some.failures == [] and "skipped 4 of the forward's ops" in some.summary
    nothing = PropertyResult("recompute", True)  # a segment that re-ran nothing at all
    _check_freed(full, run(100, 0), nothing)
    assert nothing.failures


def test_a_selective_re_run_is_localised_as_a_subsequence() -> None:
    found = localise(resolve("correct_impls:user_matmul_policy_checkpoint"), TINY_ATTENTION)
    assert found.divergence is None and found.matched, found.describe()


@pytest.mark.parametrize("name", ["recomputed-kept", "saved-inputs-kept",
                                  "stash-kept-after-warmup"])
def test_memory_faults_still_fail_with_the_leak_named(name: str) -> None:
    fault = next(m for m in MUTANTS if m.name == name)
    verdict = verify(Implementation(name, fault.impl), find_case("2L-layer-manual-attn"))
    recompute = verdict.properties[-1]
    assert recompute.passed is False
    assert "still alive after its backward" in recompute.summary
    assert "step 2" in recompute.summary


INPLACE = "2L-layer-inplace-ops-manual-attn-relu-dropout"


def test_torch_sac_runs_in_place_cases_and_its_refusal_is_named_loud() -> None:
    """torch-sac declines nothing: it is run, raises the mutation error on this case (a
    Linear with a bias writes through a view it tracks), and the verdict says so."""
    from gradequiv.harness.engine.verify import SAC_REFUSES_MUTATION

    sac = resolve("torch-sac")
    assert sac.declines("backward", find_case(INPLACE).features()) == ""
    verdict = verify(sac, find_case(INPLACE))
    assert verdict.passed and verdict.seconds != {}  # run, not skipped
    assert all(p.passed is None and "a loud refusal" in p.summary
               and SAC_REFUSES_MUTATION in p.summary for p in verdict.properties)


def test_a_users_policy_refusing_an_in_place_op_is_no_fault() -> None:
    """torch's SAC raises when an in-place op moves the version counter of an output its
    policy saved: loud, by design, no wrong gradient. Undeclared, the case is not
    applicable; the same error on a case without in-place ops stays a failure."""
    verdict = verify("correct_impls:user_matmul_policy_checkpoint", find_case(INPLACE))
    assert verdict.passed and verdict.error is None
    assert all(p.passed is None and "a loud refusal" in p.summary
               for p in verdict.properties)
    from gradequiv.harness.engine.verify import SAC_REFUSES_MUTATION

    def raises(function: object, *args: object, **kwargs: object) -> object:
        raise RuntimeError(SAC_REFUSES_MUTATION)

    elsewhere = verify(Implementation("raises", raises), find_case("2L-layer-manual-attn"))
    assert not elsewhere.passed and SAC_REFUSES_MUTATION in (elsewhere.error or "")


@pytest.mark.parametrize("spec", ["partitioned_in_place_checkpoint",
                                  "partitioned_reusing_checkpoint"])
def test_a_checkpoint_that_swaps_its_inputs_storage_passes(spec: str) -> None:
    """DeepSpeed's partitioned activations on one rank: each saved input's storage, the
    caller's input too, is swapped for a flat copy in forward and back in backward. The
    model's input then points at memory the step made (it is no hold: the input lives on
    anyway), and where the freed memory hosts the next layer's output that layer's input
    has the address of a tensor still alive (it is a new input: its gradient is read)."""
    from gradequiv.models import ExternalConfig

    case = Case(model=ExternalConfig("user_models:residual_stack"), dtype="fp32")
    verdict = verify(f"correct_impls:{spec}", case)
    assert verdict.passed, verdict.first_failure
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert {"grad of input blocks.1:x", "grad of input blocks.2:x"} <= {
        c.name for c in gradients.checks}
