"""Real models of the libraries people train with (issue 37), each with its library's own
checkpointing: a transformers decoder, encoder and encoder-decoder, a PEFT LoRA, a
diffusers UNet. Each is first checked against a ground truth computed here without
gradequiv (checkpointing off twice, on once, the same seeds), then through gradequiv's
check; a test skips where its library is not installed (``pip install
'gradequiv[hf,peft,diffusers]'``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import library_models
import pytest
import torch

from gradequiv.harness import Case, resolve, verify
from gradequiv.harness.commands.profiling import profile
from gradequiv.models import ExternalConfig, parse_granularity


def _hf(reentrant: bool) -> Callable[[torch.nn.Module], None]:
    def toggle(model: torch.nn.Module) -> None:
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.25 on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs=kwargs)
    return toggle


def _grads(factory: str, toggle: Callable[[torch.nn.Module], None] | None,
           autocast: bool = False) -> dict[str, torch.Tensor]:
    """One training step of the factory's model, written without gradequiv."""
    built = getattr(library_models, factory)(0)
    model = built.model
    model.train()
    if toggle is not None:
        toggle(model)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outputs = model(*built.positional, **built.keywords)
    built.loss_fn(outputs, built.targets).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The greatest relative difference between two gradient sets with the same names."""
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).norm() / max(a[n].norm(), b[n].norm(), 1e-30)) for n in a)


def _ground_truth(factory: str, toggle: Callable[[torch.nn.Module], None],
                  autocast: bool = False) -> float:
    """Full storage twice bitwise equal, and how far checkpointing on is from it."""
    first, second = _grads(factory, None, autocast), _grads(factory, None, autocast)
    assert _worst(first, second) == 0.0
    return _worst(first, _grads(factory, toggle, autocast))


def _case(factory: str, granularity: str = "layer", **kwargs: Any) -> Case:
    return Case(model=ExternalConfig(f"library_models:{factory}"),
                granularity=parse_granularity(granularity), **kwargs)


def _failing(verdict: Any) -> dict[str, str]:
    return {p.name: p.summary for p in verdict.properties if p.passed is False}


@pytest.fixture(autouse=True)
def _quiet_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")


@pytest.mark.parametrize("factory, reentrant, dtype", [
    ("qwen2", False, "fp32"), ("qwen2", True, "bf16-autocast"),
    ("bert", False, "fp32"), ("bert", True, "fp32"),
    ("t5", False, "fp32"),
])
def test_transformers_models_with_their_own_checkpointing_pass(
        factory: str, reentrant: bool, dtype: str) -> None:
    pytest.importorskip("transformers")
    assert _ground_truth(factory, _hf(reentrant), autocast=dtype != "fp32") == 0.0
    impl = resolve("hf", kwargs={"use_reentrant": True} if reentrant else None)
    for granularity in ("layer", "every:2"):
        verdict = verify(impl, _case(factory, granularity, dtype=dtype))
        assert verdict.passed, verdict.error or _failing(verdict)


def test_t5_under_reentrant_checkpoint_passes_its_position_bias_as_evidence() -> None:
    """The first block's position bias reaches the second as the checkpoint's output, whose
    gradient lacks the first block's own use of it (full storage's has it): the case failed
    on 'grad of input decoder.block.1:position_bias', relative error 0.7. The parameters'
    gradients are within the bound: the decoder's bitwise, the encoder's (every decoder
    block reads its output) summed in another order, about 4e-7 in the ground truth."""
    pytest.importorskip("transformers")
    assert _ground_truth("t5", _hf(True)) < 1e-6
    verdict = verify(resolve("hf", kwargs={"use_reentrant": True}), _case("t5"))
    assert verdict.passed, verdict.error or _failing(verdict)
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert "evidence, not a fault: grad of input decoder.block.1:position_bias: relative " \
           "error" in gradients.summary or "evidence, not a fault: grad of input " \
           "encoder.block.1:position_bias: relative error" in gradients.summary


def test_an_encoder_under_reentrant_checkpoint_and_bf16_autocast_differs_and_says_where() -> None:
    """A real difference (the ground truth has it too): the re-run's input is a detached leaf
    that requires grad, which autocast's cast cache casts once for the query, key and value
    projections; its gradient is then summed in bfloat16, not in float32 (with the cache off
    on both paths they agree). The headline is a projection's weight, not a bias whose
    gradient is 1e-11."""
    pytest.importorskip("transformers")
    assert _ground_truth("bert", _hf(True), autocast=True) > 1e-5
    verdict = verify(resolve("hf", kwargs={"use_reentrant": True}),
                     _case("bert", dtype="bf16-autocast"))
    headline = _failing(verdict)["gradients"]
    assert headline.startswith("grad of encoder.layer.0.") and ".weight" in headline.split(":")[0]
    torch.set_autocast_cache_enabled(False)  # the evidence the autocast-cast-cache cause reads
    try:
        assert verify(resolve("hf", kwargs={"use_reentrant": True}),
                      _case("bert", dtype="bf16-autocast")).passed
    finally:
        torch.set_autocast_cache_enabled(True)


def test_a_peft_lora_passes_under_both_checkpoints() -> None:
    """PEFT names every module under base_model.model.; the base is frozen, so under
    reentrant checkpoint transformers makes the embeddings' output require grad."""
    pytest.importorskip("peft")
    for reentrant in (False, True):
        assert _ground_truth("lora_llama", _hf(reentrant)) == 0.0
        impl = resolve("hf", kwargs={"use_reentrant": True} if reentrant else None)
        verdict = verify(impl, _case("lora_llama"))
        assert verdict.passed, verdict.error or _failing(verdict)
        grads = {c.name for p in verdict.properties for c in p.checks}
        assert "grad of base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" \
            in grads


def test_a_diffusers_unet_passes_with_its_own_toggle() -> None:
    pytest.importorskip("diffusers")
    assert _ground_truth("unet", library_models.diffusers_checkpointing) == 0.0
    impl = resolve("library_models:diffusers_checkpointing", adapter="toggle")
    assert impl.chooses_segments
    verdict = verify(impl, _case("unet", "toggle"))
    assert verdict.passed, verdict.error or _failing(verdict)


def test_profile_runs_on_a_transformers_model() -> None:
    """``profile --model`` crashed on the CausalLMOutputWithPast a decoder returns."""
    pytest.importorskip("transformers")
    result = profile(resolve("hf"), _case("qwen2"), [parse_granularity("none"),
                                                    parse_granularity("layer")],
                     steps=1, warmup=0)
    none, layer = result.rows
    assert 0 < layer.held_bytes < none.held_bytes
