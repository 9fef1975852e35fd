"""A user's model run exactly as its code runs it (issue 26): the segment handed to an
implementation is the user's own module, hooks, parameters and names; layers that save
nothing or are skipped are no failure."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import user_models
from torch import Tensor, nn

from gradequiv.harness import Case, Implementation, resolve, verify
from gradequiv.harness.cli import main
from gradequiv.harness.engine.saves import saved_since
from gradequiv.harness.implementations.faults import MUTANTS, reference_checkpoint
from gradequiv.models import ExternalConfig, build, parse_granularity
from gradequiv.models.external import ExternalModel

#: Unusual but safe to recompute (the residual stack is test_external's).
SAFE = ["moe_with_router", "pruned_layers", "layerdrop"]
BUILTINS = ["torch", "torch-reentrant", "torch-sac", "torch-wrapper", "torch-patched",
            "torch-offload", "torch-offload-wrapper"]


class _ParamsAsInputs(torch.autograd.Function):
    """A hand-written checkpoint that takes the segment's parameters as inputs, found as
    many codebases find them: ``function.__self__.parameters()``."""

    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], kwargs: dict[str, Any], n: int,
                *tensors: Tensor) -> Any:
        ctx.function, ctx.kwargs = function, kwargs
        ctx.rng, ctx.autocast = torch.get_rng_state(), torch.is_autocast_enabled("cpu")
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors[:n])
        with torch.no_grad():
            return function(*tensors[:n], **kwargs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        params = list(ctx.function.__self__.parameters())
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autocast("cpu", enabled=ctx.autocast):
            torch.set_rng_state(ctx.rng)
            out = ctx.function(*inputs, **ctx.kwargs)
        pairs = [(o, g) for o, g in zip(out if isinstance(out, tuple) else (out,), grads)
                 if o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad] + params
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                       allow_unused=True))
        return (None, None, None, *[next(got) if t.requires_grad else None for t in inputs],
                *got)


def params_as_inputs(function: Callable[..., Any], *args: Tensor, **kwargs: Any) -> Any:
    params = list(function.__self__.parameters())  # type: ignore[attr-defined]
    return _ParamsAsInputs.apply(function, kwargs, len(args), *args, *params)


def _user_case(factory: str, granularity: str = "layer", **kwargs: Any) -> Case:
    return Case(model=ExternalConfig(f"user_models:{factory}"),
                granularity=parse_granularity(granularity), **kwargs)


def _recompute(verdict: Any) -> Any:
    return next(p for p in verdict.properties if p.name == "recompute")


# -- what the harness adds to a user's model: nothing --------------------------------------

def test_the_user_s_modules_keep_their_attributes_and_a_submodule_named_router() -> None:
    """The harness once set ``router`` on every module, shadowing the MoE layers' own."""
    torch.manual_seed(0)
    plain = user_models.moe_with_router(0).model
    torch.manual_seed(0)
    routed = build(ExternalConfig("user_models:moe_with_router"), Case().batch, 0).model
    assert isinstance(routed, ExternalModel)
    for (name, mine), (_, theirs) in zip(routed.inner.named_modules(), plain.named_modules()):
        assert vars(mine).keys() == vars(theirs).keys(), name
        assert type(mine).__name__ == type(theirs).__name__ and isinstance(mine, type(theirs))
    layer = routed.inner.inner[0]
    assert isinstance(layer.router, nn.Linear)  # not the harness's
    routed(*user_models.moe_with_router(0).inputs)  # the layers run with their router


def test_the_function_adapter_gets_the_user_s_module_s_own_call() -> None:
    workload = build(ExternalConfig("user_models:residual_stack"), Case().batch, 0)
    blocks = workload.model.inner.blocks
    got: list[Any] = []

    def record(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        got.append(function)
        return function(*args, **kwargs)

    segments = workload.segments(parse_granularity("layer"))
    Implementation("record", record).install(workload.model, segments)
    workload.model(*workload.inputs)
    assert [f.__self__ for f in got] == list(blocks)
    assert all(len(list(f.__self__.parameters())) == 4 for f in got)
    assert [s.module for s in segments] == list(blocks)


def test_the_wrapper_adapter_gets_the_user_s_module_itself() -> None:
    workload = build(ExternalConfig("user_models:residual_stack"), Case().batch, 0)
    got: list[nn.Module] = []

    def wrap(module: nn.Module) -> nn.Module:
        got.append(module)
        return module  # calling it from inside the router runs it plainly

    Implementation("wrap", wrap, adapter="wrapper").install(
        workload.model, workload.segments(parse_granularity("layer")))
    out = workload.model(*workload.inputs)
    assert got == list(workload.model.inner.blocks) and out.shape == (8, 3)


def test_the_segment_s_hooks_run_inside_the_recompute() -> None:
    """As under ``checkpoint(block, x)``: the pre-hook runs in the forward and again in
    backward, and a forward hook that changes the output changes it in the re-run too."""
    workload = build(ExternalConfig("user_models:residual_stack"), Case().batch, 0)
    block = workload.model.inner.blocks[1]
    calls: list[bool] = []
    block.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
    segments = workload.segments(parse_granularity("layer"))
    resolve("torch-reentrant").install(workload.model, segments)
    loss = workload.loss_fn(workload.model(*workload.inputs), workload.targets)
    assert calls == [False]  # reentrant: the forward runs under no_grad
    loss.backward()
    assert calls == [False, True]


# -- every correct implementation passes every safe user model ---------------------------------

@pytest.mark.parametrize("factory", SAFE)
@pytest.mark.parametrize("spec", [*BUILTINS, "reference", "params-as-inputs"])
def test_correct_implementations_pass_every_safe_user_model(spec: str, factory: str) -> None:
    impl = {"reference": Implementation(spec, reference_checkpoint),
            "params-as-inputs": Implementation(spec, params_as_inputs)}.get(spec) \
        or resolve(spec)
    verdict = verify(impl, _user_case(factory), floor_when_needed=True)
    assert verdict.passed, (verdict.error or "") + "; ".join(
        f"{p.name}: {p.summary}" for p in verdict.properties if p.passed is False)


def test_a_stateful_pre_hook_on_a_segment_fails_and_its_state_is_named() -> None:
    """The recompute runs the hook again, as real training under checkpoint does: the
    running statistic it keeps is updated twice."""
    verdict = verify(resolve("torch"), _user_case("hooked_running_mean"))
    buffers = next(p for p in verdict.properties if p.name == "buffers")
    assert verdict.error is None and buffers.passed is False
    assert buffers.summary.startswith("buffer blocks.0.input_mean: relative error")


# -- what saved nothing has nothing to re-run; what was skipped has nothing to free ----------

def test_pruned_layers_pass_and_the_summary_says_they_had_nothing_to_re_run() -> None:
    every = _recompute(verify(resolve("torch"), _user_case("pruned_layers")))
    assert every.passed is True
    assert ("not applicable on steps 1, 2: blocks.0, blocks.2 saved nothing for backward: "
            "nothing to re-run") in every.summary
    pruned_only = _recompute(verify(resolve("torch"), _user_case("pruned_layers", "every:2")))
    assert pruned_only.passed is True
    assert pruned_only.summary.endswith(
        "not applicable on steps 1, 2: no selected segment saved a tensor for backward "
        "(skipped or saving nothing): nothing to re-run or to free")


def test_a_segment_that_saved_activations_and_did_not_re_run_still_fails() -> None:
    no_op = next(m for m in MUTANTS if m.name == "no-op")
    result = _recompute(verify(Implementation("no-op", no_op.impl), _user_case("pruned_layers")))
    assert result.passed is False
    assert "step 1: blocks.1 did not run again in backward" in result.summary
    assert not any("blocks.0 " in f or "blocks.2 " in f for f in result.failures)


@pytest.mark.parametrize("dtype", ["fp32", "bf16-autocast"])
def test_layerdrop_passes_on_every_seed_and_a_step_that_skipped_all_has_nothing_to_free(
        dtype: str) -> None:
    summaries = []
    for seed in range(4):
        verdict = verify(resolve("torch"), _user_case("layerdrop", "every:2", seed=seed,
                                                       dtype=dtype))
        assert verdict.passed, [p.summary for p in verdict.properties if p.passed is False]
        summaries.append(_recompute(verdict).summary)
    assert any("no selected segment saved a tensor for backward (skipped or saving "
               "nothing): nothing to re-run or to free" in s for s in summaries)


def test_a_first_micro_batch_that_skipped_every_selected_layer_has_nothing_to_free() -> None:
    """Held bytes are measured on the first micro-batch's forward; at step 2 of this case
    LayerDrop skipped all three blocks there, and not in the second."""
    case = _user_case("layerdrop", seed=4, grad_mode="accumulate")
    result = _recompute(verify(resolve("torch"), case))
    assert result.passed is True
    assert result.summary.endswith(
        "not applicable on step 2: no selected segment saved a tensor for backward in the "
        "first micro-batch, whose held bytes are measured: nothing to free")


def test_saved_since_reads_what_a_call_saved_from_its_graph() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    linear = nn.Linear(4, 4)
    start = torch._C._autograd._get_sequence_nr()
    assert saved_since(linear(x), start)
    start = torch._C._autograd._get_sequence_nr()
    assert not saved_since((x, x.view(4, 3), x + 1, 7), start)  # nothing kept for backward
    with torch.no_grad():
        start = torch._C._autograd._get_sequence_nr()
        assert not saved_since(linear(x), start)


@pytest.mark.slow  # whole check runs; the routing itself is held by the tests above
@pytest.mark.parametrize("factory, status", [*((f, 0) for f in SAFE),
                                              ("hooked_running_mean", 1)])
def test_gradequiv_check_passes_the_safe_user_models_and_fails_the_unsafe_one(
        factory: str, status: int, capsys: pytest.CaptureFixture[str]) -> None:
    """``check --impl torch`` passed 1 of these 4 safe models (the MoE one crashed every test
    with "'Tensor' object is not callable"), and passed the unsafe hook."""
    assert main(["check", "--in-process", "--impl", "torch", "--model",
                 f"user_models:{factory}", "--examples", "2"]) == status


# -- a segment input whose gradient the two paths measure at different tensors ----------------

def _gradients(verdict: Any) -> Any:
    return next(p for p in verdict.properties if p.name == "gradients")


def test_a_bias_passed_on_from_a_checkpointed_layer_is_evidence_and_a_real_fault_still_fails(
        ) -> None:
    """T5's shape under reentrant checkpoint: the first block's position bias reaches the
    later blocks as the checkpoint's output, whose gradient has only their share; with
    full storage it is the tensor the first block also used, and its gradient has that
    block's share too. Every parameter's gradient agreed, and the case failed on 'grad of
    input blocks.1:position'. The same model with the RNG state not restored still fails,
    on its parameters."""
    toggle = resolve("user_models:shared_bias_checkpointing", adapter="toggle")
    for granularity in ("layer", "every:2"):
        verdict = verify(toggle, _user_case("shared_bias_stack", granularity))
        gradients = _gradients(verdict)
        assert verdict.passed, gradients.summary
        assert re.search(r"evidence, not a fault: grad of input blocks\.[12]:position: "
                         r"relative error", gradients.summary)
        assert all(c.mismatched == 0 for c in gradients.checks)
        assert not any(c.name.endswith(":position") for c in gradients.checks)
    faulty = verify(resolve("user_models:shared_bias_checkpointing_without_rng",
                            adapter="toggle"), _user_case("shared_bias_stack"))
    gradients = _gradients(faulty)
    assert gradients.passed is False
    failing = {c.name for c in gradients.checks if not c.passed}
    assert "grad of blocks.1.linear.weight" in failing
    assert "grad of input blocks.1:position" in failing  # a fault's evidence is no excuse
