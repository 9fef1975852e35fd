"""Each property fails on an implementation that breaks it, and holds on torch's own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import wrong_impls

from gradequiv.harness import Case, Implementation, Verdict, find_case, resolve, verify
from gradequiv.models import BatchConfig, TransformerConfig, parse_granularity

DROPOUT = dict(embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1, mlp_dropout=0.1)
CASE = Case(
    model=TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=16, **DROPOUT),
    batch=BatchConfig(2, 8), granularity=parse_granularity("layer"), seed=3, name="t",
)


def statuses(verdict: Verdict) -> dict[str, bool | None]:
    return {p.name: p.passed for p in verdict.properties}


def run(fn: object, case: Case = CASE, adapter: str = "function") -> Verdict:
    return verify(Implementation("test", fn, adapter), case)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["torch", "torch-reentrant"])
def test_torch_checkpoint_holds_every_property(spec: str) -> None:
    verdict = verify(spec, CASE)
    assert verdict.passed, verdict.first_failure
    s = statuses(verdict)
    assert s.pop("inference") is None and set(s.values()) == {True}  # no eval forward here
    assert all(c.mismatched == 0 for p in verdict.properties for c in p.checks)


def test_wrong_outputs_fail_the_outputs_property() -> None:
    verdict = run(wrong_impls.scaled_output)
    assert statuses(verdict)["outputs"] is False
    assert verdict.first_failure.startswith("outputs: ")


def test_a_1e_4_gradient_error_fails_gradients_only_at_step_one() -> None:
    s = statuses(run(wrong_impls.skewed_gradients))
    assert s["outputs"] is True and s["rng"] is True and s["recompute"] is True
    assert s["gradients"] is False


def test_nan_gradients_are_infinitely_wrong() -> None:
    verdict = run(wrong_impls.nan_gradients)
    bad = [c for c in verdict.properties[1].checks if not c.passed]
    assert bad and all(c.rel_error == float("inf") for c in bad)


def test_buffers_updated_twice_fail_and_a_guarded_recompute_passes() -> None:
    case = find_case("batchnorm-layer")
    torch_verdict = verify("torch", case)
    buffers = next(p for p in torch_verdict.properties if p.name == "buffers")
    failing = {c.name for c in buffers.checks if not c.passed}
    assert buffers.passed is False
    assert {"buffer blocks.0.bn.num_batches_tracked", "buffer blocks.0.bn.running_mean"} <= failing
    guarded = run(wrong_impls.buffer_guarded, case)
    assert guarded.passed, guarded.first_failure


def test_a_moved_caller_rng_fails_rng_while_step_one_gradients_hold() -> None:
    s = statuses(run(wrong_impls.moves_caller_rng))
    assert s["outputs"] is True and s["gradients"] is True
    # Step 2 starts from the full path's RNG state, so only the rng property sees it.
    assert s["rng"] is False and s["trajectory"] is True


def test_a_fault_on_the_second_step_fails_the_trajectory_only() -> None:
    wrong_impls._calls.clear()
    s = statuses(run(wrong_impls.wrong_from_second_step))
    assert s == {"outputs": True, "gradients": True, "buffers": True, "rng": True,
                 "trajectory": False, "inference": None, "recompute": True}


def test_a_no_op_checkpoint_fails_recompute_only() -> None:
    verdict = run(wrong_impls.no_op)
    s = statuses(verdict)
    assert s.pop("recompute") is False and s.pop("inference") is None
    assert set(s.values()) == {True}
    messages = next(p for p in verdict.properties if p.name == "recompute").failures
    assert any("did not run again in backward" in m for m in messages)
    assert any("nothing was freed" in m for m in messages)


def test_granularity_none_makes_recompute_not_applicable() -> None:
    verdict = verify("torch", replace(CASE, granularity=parse_granularity("none")))
    assert verdict.passed and statuses(verdict)["recompute"] is None


def test_dropped_kwargs_are_caught() -> None:
    assert not run(wrong_impls.drops_kwargs).passed


def test_reentrant_checkpoint_without_input_grads_is_a_failed_verdict_not_a_crash() -> None:
    verdict = verify("torch-reentrant", find_case("2L-layer-frozen-embeddings"))
    assert not verdict.passed
    assert "exists only on the full-storage path" in verdict.first_failure
    assert any("requires_grad" in w for w in verdict.warnings)


@pytest.mark.parametrize("fn, where, text", [
    (wrong_impls.raises_in_backward, "step 1 backward", "freed before backward"),
    (wrong_impls.returns_tuple, "step 1 forward", "tuple"),
])
def test_an_implementation_that_raises_is_a_failed_verdict(fn: object, where: str,
                                                           text: str) -> None:
    verdict = run(fn)
    assert not verdict.passed and verdict.error_at == where
    assert "Traceback" in (verdict.error or "") and text in verdict.first_failure
    assert set(statuses(verdict).values()) == {None}


def test_the_caller_rng_is_left_as_it_was() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    verify("torch", CASE)
    assert torch.equal(torch.get_rng_state(), before)


def test_bf16_autocast_on_cpu_is_bitwise_for_torch() -> None:
    verdict = verify("torch", replace(CASE, dtype="bf16-autocast"))
    assert verdict.passed
    grads = next(p for p in verdict.properties if p.name == "gradients")
    assert grads.checks and all(c.bound < 1e-5 for c in grads.checks)


def test_recompute_path_holds_fewer_bytes_for_every_granularity() -> None:
    base = replace(CASE, model=replace(CASE.model, n_layer=4))
    for text in ("layer", "every:2", "group:2", "attention", "mlp"):
        verdict = verify("torch", replace(base, granularity=parse_granularity(text)))
        held = verdict.held_bytes
        assert held["recompute"] is not None and held["full"] is not None
        assert 0 < held["recompute"] < held["full"], text


def test_wrapper_and_toggle_adapters() -> None:
    assert run(wrong_impls.CheckpointWrapper, adapter="wrapper").passed
    assert run(wrong_impls.toggle_on, adapter="toggle").passed
    forgotten = statuses(run(wrong_impls.toggle_forgotten, adapter="toggle"))
    assert forgotten["recompute"] is False


def test_torch_checkpoint_wrapper_by_reference() -> None:
    impl = resolve(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:checkpoint_wrapper",
        adapter="wrapper",
    )
    verdict = verify(impl, replace(CASE, granularity=parse_granularity("attention")))
    assert verdict.passed, verdict.first_failure


def test_impl_kwargs_reach_the_implementation() -> None:
    wrong = verify(resolve("torch", kwargs={"preserve_rng_state": False}), CASE)
    assert statuses(wrong)["gradients"] is False and statuses(wrong)["rng"] is False
    assert "relative error" in wrong.first_failure


def test_a_steps_records_are_not_changed_by_later_steps() -> None:
    """Input leaves keep .grad across steps unless reset; a record must hold its own step."""
    from gradequiv.harness.engine.runner import run_path

    case = find_case("batchnorm-layer")
    two = run_path(case, None, device=torch.device("cpu"))
    three = run_path(replace(case, steps=3), None, device=torch.device("cpu"))
    for key in ("input:model:arg0", "param:blocks.0.fc.weight"):
        assert torch.equal(two.steps[0].grads[key], three.steps[0].grads[key]), key
        assert torch.equal(two.steps[1].grads[key], three.steps[1].grads[key]), key


def test_a_wrapper_that_patches_forward_keeps_the_input_names() -> None:
    """Segment inputs are named from the class's forward, not as arg0, arg1."""
    from gradequiv.harness import resolve

    impl = resolve("wrong_impls:patches_forward_in_place", adapter="wrapper")
    verdict = verify(impl, find_case("2L-layer-manual-attn"))
    by_name = {p.name: p for p in verdict.properties}
    assert by_name["gradients"].passed, by_name["gradients"].summary
    names = {c.name for c in by_name["gradients"].checks}
    assert {"grad of input blocks.0:x", "grad of input blocks.1:x"} <= names


def test_a_verdict_for_a_shrink_try_judges_what_its_data_supports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a case tried while shrinking another property's failure costs: no storage is
    watched (no activation counter made) and, where asked, one step runs; the verdict on
    every property the data supports is the whole verdict's, the others are said to be
    unchecked rather than passed."""
    from gradequiv.harness.engine import runner

    made: list[object] = []
    counter = runner.ActivationCounter

    def counted(*args: object, **kwargs: object) -> object:
        made.append(None)
        return counter(*args, **kwargs)

    monkeypatch.setattr(runner, "ActivationCounter", counted)
    for fn in (wrong_impls.no_op, wrong_impls.skewed_gradients):
        impl = Implementation("test", fn, "function")  # type: ignore[arg-type]
        whole = statuses(verify(impl, CASE))
        assert made, "the whole verdict watches memory"
        made.clear()
        probe = verify(impl, CASE, watch_memory=False)
        assert not made and not probe.memory_watched
        recompute = next(p for p in probe.properties if p.name == "recompute")
        assert recompute.passed is None and "no memory was watched" in recompute.summary
        assert statuses(probe) == whole | {"recompute": None}
        first = verify(impl, CASE, watch_memory=False, first_step_only=True)
        assert first.first_step_only and not made
        assert statuses(first) == whole | {"recompute": None, "rng": None, "trajectory": None}


def _check(name: str, scale: float, rel_error: float, passed: bool = False) -> object:
    from gradequiv.harness.engine.verify import TensorCheck

    return TensorCheck("gradients", name, passed, rel_error, 9.5e-7, 0.0, rel_error * scale,
                       1.0, 1, 1, 1, None, scale)


def test_a_gradient_that_is_zero_but_for_rounding_is_evidence_not_a_fault() -> None:
    """A key projection's bias gets a gradient softmax cancels: 1e-15 on one path, 8e-15 on
    the other, relative error about 1. Against the step's gradients together it is rounding
    noise; a gradient of a scale that matters, off by as much, still fails."""
    from gradequiv.harness.engine.verify import PropertyResult, _rounding_noise

    noise = _check("grad of layers.0.attn.k_proj.bias", 8e-15, 0.9)
    small = _check("grad of layers.0.norm.bias", 1e-4, 0.9)  # small, and a real value
    weight = _check("weight after step 2: layers.0.attn.k_proj.bias", 1e-16, 0.5)
    result = PropertyResult("gradients", False, checks=[
        _check("grad of layers.0.attn.q_proj.weight", 1.0, 1e-8, passed=True), noise, small,
        _check("step 2 grad of layers.0.attn.k_proj.bias", 1e-3, 0.9),
        _check("step 2 grad of layers.0.attn.q_proj.weight", 1e-3, 1e-8, passed=True),
        _check("weight after step 2: layers.0.attn.q_proj.weight", 5.0, 1e-8, passed=True),
        weight])
    # the step-2 bias is noise of nothing: its step's gradients are of its own scale
    assert _rounding_noise(result) == [noise, weight]


def test_bart_under_reentrant_checkpoint_passes_with_its_cancelled_key_bias() -> None:
    """Bart's key-projection biases get gradients softmax cancels (about 1e-15), summed in
    another order by a reentrant re-run: no fault, where every other tensor is within its
    fp32 bound."""
    pytest.importorskip("transformers")
    from gradequiv.models import ExternalConfig

    case = Case(model=ExternalConfig("hf:BartForConditionalGeneration"),
                granularity=parse_granularity("layer"))
    verdict = verify(resolve("hf", kwargs={"use_reentrant": True}), case)
    assert verdict.passed, verdict.first_failure
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert "evidence, not a fault: grad of model.encoder.layers.0.self_attn.k_proj.bias" \
        in gradients.summary
