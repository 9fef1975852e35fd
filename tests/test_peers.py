"""The built-in adapters of real implementations: each gives its library's real verdict.

A test whose library is missing skips; the verdicts asserted here are the
ones docs/implementations.md reports (failures included: an adapter that
"fixed" a library's fault would hide it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from gradequiv.harness import Verdict, find_case, resolve, verify
from gradequiv.harness.implementations import libraries, torch_builtins
from gradequiv.harness.implementations.resolve import BUILTINS, builtin_target
from gradequiv.models import InvalidArgument


def needs(module: str) -> None:
    """Skip unless ``module`` is installed (found without importing it: imports warn)."""
    top = module.split(".")[0]  # find_spec of a dotted name raises when its parent is missing
    if importlib.util.find_spec(top) is None or importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'gradequiv[peers]')")


def failing(verdict: Verdict) -> set[str]:
    return {p.name for p in verdict.properties if p.passed is False}


def bitwise_pass(verdict: Verdict) -> bool:
    checks = [c for p in verdict.properties for c in p.checks]
    return verdict.passed and bool(checks) and all(c.mismatched == 0 for c in checks)


@pytest.mark.parametrize(("spec", "adapter"), [
    ("torch-sac", "function"), ("torch-wrapper", "wrapper"), ("fairscale", "wrapper"),
    ("deepspeed", "function"), ("deepspeed-nonreentrant", "function"), ("megatron", "function"),
    ("deepspeed-partitioned", "function"), ("deepspeed-partitioned-cpu", "function"),
])
def test_each_library_is_a_builtin_with_its_adapter(spec: str, adapter: str) -> None:
    assert BUILTINS[spec][1] == adapter


def test_torch_sac_is_bitwise_equal_and_its_policy_changes_what_is_held() -> None:
    case = find_case("2L-layer-bf16-dropout")
    matmuls = verify("torch-sac", case)
    assert bitwise_pass(matmuls), matmuls.first_failure
    plain = verify(resolve("torch-sac", kwargs={"policy": "none"}), case)
    assert bitwise_pass(plain), plain.first_failure
    # Saving the matmul outputs holds more than recomputing everything, less than none.
    held, held_plain = matmuls.held_bytes["recompute"], plain.held_bytes["recompute"]
    assert held is not None and held_plain is not None
    assert held_plain < held < matmuls.held_bytes["full"]  # type: ignore[operator]


def test_torch_sac_refuses_an_unknown_policy() -> None:
    with pytest.raises(InvalidArgument, match=r"policy='matmul' is not one of matmuls, none, "):
        resolve("torch-sac", kwargs={"policy": "matmul"})
    with pytest.raises(InvalidArgument, match="--impl-kwarg policy=matmuls"):
        torch_builtins.torch_sac(torch.sin, torch.ones(2), policy="bogus")


def test_torch_wrapper_passes_and_its_reentrant_option_reaches_torch() -> None:
    case = find_case("2L-layer-frozen-embeddings")
    assert bitwise_pass(verify("torch-wrapper", case))
    # Reentrant checkpoint gives the first layer no gradient when no input requires grad.
    reentrant = verify(resolve("torch-wrapper", kwargs={"reentrant": True}), case)
    assert "gradients" in failing(reentrant)


def test_fairscale_loses_cpu_autocast_but_keeps_batchnorm_statistics() -> None:
    needs("fairscale")
    assert bitwise_pass(verify("fairscale", find_case("2L-layer-manual-attn")))
    assert failing(verify("fairscale", find_case("2L-layer-bf16-nodropout"))) == {
        "gradients", "trajectory"}
    # torch's checkpoint updates running statistics twice; fairscale's patch_batchnorm does not.
    assert bitwise_pass(verify("fairscale", find_case("batchnorm-layer")))


def test_deepspeed_reentrant_loses_autocast_and_frozen_input_gradients() -> None:
    needs("deepspeed")
    assert bitwise_pass(verify("deepspeed", find_case("2L-layer-manual-attn")))
    assert failing(verify("deepspeed", find_case("2L-layer-bf16-dropout"))) == {
        "gradients", "trajectory"}
    assert "gradients" in failing(verify("deepspeed", find_case("2L-layer-frozen-embeddings")))


def test_deepspeed_nonreentrant_raises_under_autocast() -> None:
    needs("deepspeed")
    assert bitwise_pass(verify("deepspeed-nonreentrant", find_case("2L-layer-frozen-embeddings")))
    verdict = verify("deepspeed-nonreentrant", find_case("2L-layer-bf16-nodropout"))
    assert verdict.error is not None and "same dtype" in verdict.error
    assert verdict.error_at == "step 1 backward"


def test_deepspeed_nonreentrant_s_raise_is_named_by_the_autocast_its_re_run_lost() -> None:
    """Its re-run runs the first matmul in float32 and then mixes dtypes: the ops it ran
    before it raised say why."""
    from test_diagnosis import diagnosed

    needs("deepspeed")
    cause, sentence, _ = diagnosed("deepspeed-nonreentrant", "2L-layer-bf16-nodropout")
    assert cause == "autocast-lost", sentence
    assert "the re-run then raised: RuntimeError: expected m1 and m2 to have the same dtype" \
        in sentence


def test_megatron_needs_cuda_and_says_why() -> None:
    needs("megatron.core")
    if torch.cuda.is_available():
        assert bitwise_pass(verify("megatron", find_case("2L-layer-manual-attn"),
                                   device="cuda"))
        return
    with pytest.raises(InvalidArgument, match="needs CUDA: .*_get_cuda_rng_state"):
        libraries.require("megatron")


@pytest.mark.parametrize("spec", ["fairscale", "deepspeed", "deepspeed-nonreentrant",
                                  "megatron"])
def test_a_missing_library_names_its_extra(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    target = builtin_target(spec)
    monkeypatch.setattr(libraries, "_import", missing)
    extra = libraries.EXTRAS[spec][0]
    with pytest.raises(InvalidArgument, match=rf"--impl='{spec}' needs .*"
                                              rf"pip install 'gradequiv\[{extra}\]'"):
        libraries.require(spec)
    with pytest.raises(InvalidArgument, match=rf"gradequiv\[{extra}\]"):
        resolve(spec)  # at resolution: exit 2 before any case runs
    with pytest.raises(InvalidArgument, match=rf"gradequiv\[{extra}\]"):
        target(torch.nn.Identity()) if spec == "fairscale" else target(torch.sin, torch.ones(1))


@pytest.mark.parametrize("args, message", [
    (["--impl", "torch-sac", "--impl-kwarg", "policy=matmul"], "policy='matmul' is not one of"),
    (["--impl", "megatron"], "megatron"),
])
def test_an_implementation_that_cannot_run_here_is_exit_2(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "megatron" in args and torch.cuda.is_available():
        pytest.skip("megatron runs on this machine")
    from gradequiv.harness.cli import main

    assert main(["check", "--in-process", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_hf_toggle_passes_on_tiny_llama_and_gpt2_and_catches_a_missing_rng_restore() -> None:
    needs("transformers")
    from gradequiv.harness import Case
    from gradequiv.models import ExternalConfig

    for factory in ("gradequiv.models.hf:llama", "gradequiv.models.hf:gpt2"):
        case = Case(model=ExternalConfig(factory), dtype="bf16-autocast")
        assert bitwise_pass(verify(resolve("hf"), case))
    broken = verify(resolve("hf", kwargs={"preserve_rng_state": False}),
                    Case(model=ExternalConfig("gradequiv.models.hf:llama")))
    assert "gradients" in failing(broken)


def test_hf_toggle_keeps_recompute_to_the_selected_layers() -> None:
    needs("transformers")
    from gradequiv.harness import Case
    from gradequiv.models import ExternalConfig, build, parse_granularity

    workload = build(ExternalConfig("gradequiv.models.hf:llama"), Case().batch, 0, "cpu")
    segments = workload.segments(parse_granularity("every:2"))
    resolve("hf").install(workload.model, segments)
    layers = workload.model.inner.model.layers  # type: ignore[union-attr]
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]


def test_hf_toggle_is_transformers_current_one_and_takes_its_offload_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From transformers 5.25 the toggle is ``activation_checkpointing_enable`` (the old
    one warns, which this suite makes an error), and ``offload`` is the toggle's option,
    not torch's checkpoint's; before 5.25 that option is refused with the reason. On a
    machine without an accelerator 5.25's offload raises (it asks for pinned memory all the
    same, though its comment says there is nothing to copy then): the verdict says so."""
    needs("transformers")
    from gradequiv.harness import Case
    from gradequiv.models import ExternalConfig, build, parse_granularity

    case = Case(model=ExternalConfig("gradequiv.models.hf:llama"))
    workload = build(case.model, case.batch, 0, "cpu")
    segments = workload.segments(parse_granularity("layer"))
    toggle = getattr(workload.model.inner, "activation_checkpointing_enable", None)
    if toggle is None:
        with pytest.raises(InvalidArgument, match="offload: an option of transformers'"):
            resolve("hf", kwargs={"offload": True}).install(workload.model, segments)
        return
    called: list[dict[str, object]] = []
    monkeypatch.setattr(type(workload.model.inner), "activation_checkpointing_enable",
                        lambda self, **kw: (called.append(kw), toggle(**kw))[1])
    resolve("hf", kwargs={"offload": True}).install(workload.model, segments)
    assert called == [{"activation_checkpointing_kwargs": {"use_reentrant": False},
                       "offload": True}]
    monkeypatch.undo()
    offloaded = verify(resolve("hf", kwargs={"offload": True}), case)
    if torch.cuda.is_available():
        assert bitwise_pass(offloaded)
    else:  # transformers 5.25 pins host memory even with no accelerator to copy from
        assert offloaded.error is not None and "pin_memory=True requires" in offloaded.error


def test_hf_without_a_transformers_model_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    needs("transformers")
    from gradequiv.harness.cli import main

    assert main(["check", "--in-process", "--impl", "hf"]) == 2
    assert "add --model gradequiv.models.hf:llama" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["fairscale", "deepspeed", "deepspeed-nonreentrant"])
def test_library_checkpoints_re_run_under_backward_s_autocast(spec: str) -> None:
    """A backward inside an autocast block, around an fp32 forward: fairscale's and
    DeepSpeed's checkpoints re-enter the forward's autocast only where it was on, so the
    re-run runs in bf16 (relative errors near 1e-2); plain fp32 backward is exact."""
    needs("fairscale" if spec == "fairscale" else "deepspeed")
    case = find_case("2L-layer-fp32-backward-autocast-dropout")
    assert bitwise_pass(verify(spec, replace(case, backward_autocast=False)))
    assert "gradients" in failing(verify(spec, case))


def test_deepspeed_cannot_backpropagate_a_forward_twice() -> None:
    """Its reentrant checkpoint drops what it saved in the first backward pass: a loss
    backpropagated in parts (retain_graph=True) raises in the second."""
    needs("deepspeed")
    verdict = verify("deepspeed", find_case("2L-layer-two-losses-dropout"))
    assert verdict.error is not None and "NoneType" in verdict.error
