"""Models shaped like the libraries' (issue 37), without the libraries: what transformers,
PEFT, timm, diffusers and torchtune do to a model when their checkpointing is on passes
where it is correct, fails where it is not, and never crashes the harness."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import user_models
from hypothesis import given, settings

from gradequiv.harness import Case, resolve, verify
from gradequiv.harness.cli import main
from gradequiv.harness.commands.profiling import profile
from gradequiv.harness.engine.verify import PropertyResult, TensorCheck
from gradequiv.models import ExternalConfig, InvalidArgument, build, parse_granularity
from gradequiv.models.external import ExternalModel


def _case(factory: str, granularity: str = "layer", **kwargs: Any) -> Case:
    return Case(model=ExternalConfig(f"user_models:{factory}"),
                granularity=parse_granularity(granularity), **kwargs)


def _drawn(strategy: Any, attr: str) -> set[str]:
    """What a strategy draws for one of a case's fields, over 30 examples."""
    seen: set[str] = set()

    @settings(max_examples=30, database=None, deadline=None)
    @given(strategy)
    def collect(case: Case) -> None:
        seen.add(str(getattr(case, attr)))

    collect()
    return seen


def _failing(verdict: Any) -> dict[str, str]:
    return {p.name: p.summary for p in verdict.properties if p.passed is False}


# -- 1. a gradient on one path only: evidence for an activation, a verdict for a leaf ---------

def test_an_activation_only_the_toggle_made_require_grad_is_evidence_not_a_failure() -> None:
    """The stack's switch makes the frozen embeddings' output and a constant position bias
    require grad under reentrant checkpoint (transformers' enable_input_require_grads, T5):
    their gradients exist on the recompute path only, and every parameter's is bitwise
    equal. It failed with 'absent on the full-storage path'."""
    verdict = verify(resolve("user_models:stack_checkpointing", adapter="toggle"),
                     _case("checkpointing_stack"))
    assert verdict.passed, _failing(verdict)
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert "evidence, not a fault: grad of input blocks.0:" in gradients.summary
    assert all(c.mismatched == 0 for c in gradients.checks)


def test_a_frozen_layer_the_toggle_trains_still_fails() -> None:
    verdict = verify(resolve("user_models:stack_checkpointing_unfreezing", adapter="toggle"),
                     _case("checkpointing_stack"))
    assert _failing(verdict)["gradients"].startswith(
        "grad of embed.weight: exists only on the recompute path")


# -- 2. a regime the model cannot run ----------------------------------------------------------

def test_a_regime_full_storage_cannot_run_is_not_applicable_in_one_line() -> None:
    """torch.fft.rfft refuses bfloat16: the bf16-model case raised on full storage, and the
    run ended without a verdict on Hypothesis's reproduce-failure text."""
    verdict = verify(resolve("torch"), _case("spectral", dtype="bf16-model"))
    assert verdict.passed and verdict.error is None
    said = {p.summary for p in verdict.properties}
    assert len(said) == 1 and all(p.passed is None for p in verdict.properties)
    (line,) = said
    assert line.startswith("not applicable to this model: bf16-model raises on full storage "
                           "itself, at step 1 forward (RuntimeError: Unsupported dtype")
    assert "\n" not in line and "reproduce_failure" not in line
    assert verify(resolve("torch"), _case("spectral", dtype="bf16-autocast")).passed


def test_a_factory_declares_the_regimes_it_runs() -> None:
    verdict = verify(resolve("torch"), _case("spectral_declared", dtype="bf16-model"))
    assert {p.summary for p in verdict.properties} == {
        "not applicable to this model: its factory declares regimes=('fp32', 'bf16-autocast', "
        "'fp16-autocast'), not bf16-model"}
    from gradequiv.properties.strategies import external_cases

    drawn = _drawn(external_cases("user_models:spectral_declared"), "dtype")
    assert drawn <= {"fp32", "bf16-autocast", "fp16-autocast"} and "fp32" in drawn


def test_a_regime_name_that_is_none_is_exit_2() -> None:
    built = user_models.spectral(0)
    built.regimes = ("bf16",)
    from gradequiv.models.external import load_user_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(user_models, "spectral_declared", lambda seed: built)
        with pytest.raises(InvalidArgument, match=r"regimes=\('bf16',\) names \['bf16'\]"):
            load_user_model(ExternalConfig("user_models:spectral_declared"), 0)


# -- 3. wrappers that rename -------------------------------------------------------------------

def test_a_toggle_that_wraps_modules_is_followed_by_identity() -> None:
    """torch's apply_activation_checkpointing adds _checkpoint_wrapped_module to every name
    below a wrapped block: the restore at step 2 raised KeyError and blamed the
    implementation. Names stay the user's."""
    verdict = verify(resolve("user_models:apply_activation_checkpointing", adapter="toggle"),
                     _case("residual_stack"))
    assert verdict.passed, verdict.error or _failing(verdict)
    names = [c.name for p in verdict.properties for c in p.checks]
    assert "grad of blocks.0.linear.weight" in names
    assert not any("_checkpoint_wrapped_module" in n for n in names)
    recompute = next(p for p in verdict.properties if p.name == "recompute")
    assert recompute.segments == ("blocks.0", "blocks.1", "blocks.2")


# -- 4. outputs that are no tensor -------------------------------------------------------------

@pytest.mark.parametrize("factory", ["dataclass_outputs", "dict_outputs"])
def test_structured_outputs_of_model_and_segments_pass_check_and_profile(factory: str) -> None:
    """A dataclass output crashed the runner ('StackOutput' is not iterable); an ordered dict
    with None fields (a ModelOutput) crashed profile in memory.py ('no attribute
    untyped_storage')."""
    verdict = verify(resolve("torch"), _case(factory))
    assert verdict.passed, verdict.error or _failing(verdict)
    result = profile(resolve("torch"), _case(factory), [parse_granularity("none"),
                                                        parse_granularity("layer")],
                     steps=1, warmup=0)
    none, layer = result.rows
    assert layer.held_bytes < none.held_bytes


# -- 5. toggles get the user's model and the selected segments ---------------------------------

def test_a_toggle_gets_the_user_s_model_and_the_selected_segment_names() -> None:
    got: list[Any] = []

    def toggle(model: torch.nn.Module, segments: list[str]) -> None:
        got.append((model, segments))

    workload = build(ExternalConfig("user_models:checkpointing_stack"), Case().batch, 0)
    assert isinstance(workload.model, ExternalModel)
    segments = workload.segments(parse_granularity("every:2"))
    impl = resolve("user_models:stack_checkpointing", adapter="toggle")
    impl.target = toggle
    impl.install(workload.model, segments)
    ((model, names),) = got
    assert model is workload.model.inner and names == ["blocks.0", "blocks.2"]


def test_the_readme_s_toggle_runs_on_the_user_s_model() -> None:
    """``model.set_grad_checkpointing(True)`` raised AttributeError on gradequiv's wrapper."""
    impl = resolve("user_models:grad_checkpointing", adapter="toggle")
    assert impl.chooses_segments
    verdict = verify(impl, _case("checkpointing_stack", "toggle"))
    assert verdict.passed, verdict.error or _failing(verdict)


def test_a_toggle_that_chooses_its_own_segments_has_one_granularity_said_so() -> None:
    from gradequiv.properties.strategies import external_cases

    impl = resolve("user_models:vit_grad_checkpointing", adapter="toggle")
    assert impl.chooses_segments
    assert not resolve("user_models:stack_checkpointing", adapter="toggle").chooses_segments
    drawn = external_cases("user_models:tiny_vit", toggle_chooses=True)
    assert _drawn(drawn, "granularity") == {"toggle"}
    case = _case("tiny_vit", "toggle")
    assert "granularity: the toggle's" in case.describe()
    assert Case.from_json(case.to_json()) == case
    assert verify(impl, case).passed


def test_profile_does_not_rank_rows_that_are_the_same_configuration() -> None:
    """On a timm ViT its layer and every:2 rows were byte for byte the same, and profile
    recommended one of them."""
    impl = resolve("user_models:vit_grad_checkpointing", adapter="toggle")
    result = profile(impl, _case("tiny_vit"), [parse_granularity(g) for g in
                                               ("none", "layer", "every:2")],
                     steps=1, warmup=0)
    assert [r.granularity for r in result.rows] == ["none", "toggle"]
    assert result.recommendation["knee"] in ("none", "toggle")


# -- 6. inputs by keyword, segments by class, names that match nothing ------------------------

def test_keyword_inputs_and_segments_by_class() -> None:
    """An encoder-decoder called as T5 is, by keyword, its layers named by class (a class
    and its subclass: each layer once)."""
    workload = build(ExternalConfig("user_models:encoder_decoder"), Case().batch, 0)
    names = [s.name for s in workload.segments(parse_granularity("layer"))]
    assert names == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    verdict = verify(resolve("torch"), _case("encoder_decoder"))
    assert verdict.passed, verdict.error or _failing(verdict)


def test_a_segment_name_that_matches_nothing_says_which_names_exist() -> None:
    with pytest.raises(InvalidArgument) as caught:
        build(ExternalConfig("user_models:misnamed_layers"), Case().batch, 0)
    said = str(caught.value)
    assert said.startswith("segment 'encoders.0' is not a submodule of the model; did you mean "
                           "'encoder.0'? its repeated blocks are ")
    assert "Residual (2: encoder.0 ... encoder.1)" in said and "pass the class" in said
    assert said.endswith("the model's top-level submodules are embed, encoder, decoder, head")


# -- 7. the headline tensor is the one that matters -------------------------------------------

def _check(name: str, rel: float, scale: float, bound: float = 1e-6) -> TensorCheck:
    return TensorCheck("gradients", name, False, rel, bound, 0.0, rel * scale, 1.0, 1, 10,
                       scale=scale)


def test_the_headline_is_the_tensor_whose_error_matters_at_the_gradients_scale() -> None:
    """A bias whose gradient is 1e-9 absolute was headlined over the embeddings and first
    layer, whose gradients differ by 4e-4 of their own scale."""
    bias = _check("grad of blocks.1.attn.bias", rel=0.3, scale=3e-9)
    weight = _check("grad of blocks.0.mlp.weight", rel=4e-4, scale=2.0)
    embeddings = _check("grad of embed.weight", rel=4e-4, scale=1.0)
    result = PropertyResult("gradients", False, checks=[bias, embeddings, weight],
                            segments=("blocks.0", "blocks.1"))
    assert [c.name for c in result.worst_first()] == [
        "grad of blocks.0.mlp.weight", "grad of embed.weight", "grad of blocks.1.attn.bias"]
    assert result.first_failure.startswith("grad of blocks.0.mlp.weight")


def test_reentrant_checkpoint_under_autocast_on_bert_s_layer_shape_names_the_cast_cache(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """BERT's layer: query, key and value read the layer's float32 input. Under reentrant
    checkpoint and bf16 autocast the gradients differ for real (a ground truth here, without
    gradequiv, sees it too), and the cause is autocast's cast cache, which the failure
    shows by passing with the cache off; it was named input-grads-dropped."""
    case = _case("post_norm_encoder", dtype="bf16-autocast")
    reentrant = resolve("torch-reentrant")
    assert verify(reentrant, case).passed is False
    torch.set_autocast_cache_enabled(False)
    try:
        assert verify(reentrant, case).passed  # the cache is the whole difference
    finally:
        torch.set_autocast_cache_enabled(True)
    assert verify(resolve("torch"), case).passed
    code = main(["check", "--in-process", "--impl", "torch-reentrant", "--model",
                 "user_models:post_norm_encoder", "--examples", "1",
                 "--report-dir", str(tmp_path)])
    assert code == 1, capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert [f["cause"] for f in report["faults"]] == ["autocast-cast-cache"]
    assert "summed in bfloat16 where full storage sums them in float32" in \
        report["failure"]["diagnosis"]["sentence"]


# -- 8. an implementation that cannot import what it needs -------------------------------------

def test_a_toggle_whose_import_fails_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """It was 'the implementation raised' in every case, exit 1."""
    code = main(["check", "--in-process", "--impl", "user_models:toggle_needing_a_library",
                 "--adapter", "toggle", "--model", "user_models:residual_stack",
                 "--examples", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "could not import 'torchtune_is_not_installed'" in err and err.count("\n") == 1
