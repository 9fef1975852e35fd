"""``--model hf:NAME``: a transformers architecture checked with no factory, built tiny from
its own config, its head's loss, and the layers its own toggle checkpoints as segments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradequiv.harness import Case, resolve, verify
from gradequiv.harness.cli import main
from gradequiv.models import ExternalConfig, build, parse_granularity
from gradequiv.models.library import library_factory

#: decoders, encoders, encoder-decoders and a vision model, each with its own head
ARCHITECTURES = ["Qwen2ForCausalLM", "LlamaForCausalLM", "GPT2LMHeadModel",
                 "MistralForCausalLM", "BertForMaskedLM", "RobertaForSequenceClassification",
                 "DistilBertForTokenClassification", "T5ForConditionalGeneration",
                 "BartForConditionalGeneration", "ViTForImageClassification",
                 # a multimodal decoder: its text and vision sub-configs shrunk too (Aria's
                 # were left at 18.7 billion parameters)
                 "LlavaForConditionalGeneration",
                 # speech: a waveform with a CTC transcript and with a class, and Whisper's
                 # mel frames into an encoder-decoder (SpecAugment off: numpy's generator)
                 "HubertForCTC", "Wav2Vec2ForSequenceClassification",
                 "WhisperForConditionalGeneration"]


@pytest.fixture(autouse=True)
def _quiet_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")


def _case(name: str, **kwargs: object) -> Case:
    return Case(model=ExternalConfig(f"hf:{name}"), granularity=parse_granularity("layer"),
                **kwargs)  # type: ignore[arg-type]


def test_a_library_prefix_routes_to_the_library_and_anything_else_to_a_factory() -> None:
    assert library_factory("my_models:hf") is None and library_factory("hfx:Bert") is None
    assert library_factory("hf:BertForMaskedLM") is not None


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_an_architecture_by_name_passes_with_its_own_checkpointing(name: str) -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_layers import GradientCheckpointingLayer

    workload = build(ExternalConfig(f"hf:{name}"), Case().batch, 0)
    segments = workload.segments(parse_granularity("layer"))
    assert len(segments) >= 2 and all(isinstance(s.module, GradientCheckpointingLayer)
                                       for s in segments)
    assert sum(p.numel() for p in workload.model.parameters()) < 200_000  # tiny
    verdict = verify(resolve("hf"), _case(name))
    assert verdict.passed, verdict.error or verdict.first_failure
    assert any(c.name.startswith("grad of ") for p in verdict.properties for c in p.checks)


def test_the_route_finds_what_a_factory_written_check_finds() -> None:
    """BERT under reentrant checkpoint and bf16 autocast differs for real, as the factory in
    tests/library_models.py shows (test_library_models): the same verdict here, with the
    cause named."""
    pytest.importorskip("transformers")
    reentrant = resolve("hf", kwargs={"use_reentrant": True})
    assert verify(reentrant, _case("BertForMaskedLM")).passed
    assert verify(reentrant, _case("BertForMaskedLM", dtype="bf16-autocast")).passed is False
    torch.set_autocast_cache_enabled(False)
    try:
        assert verify(reentrant, _case("BertForMaskedLM", dtype="bf16-autocast")).passed
    finally:
        torch.set_autocast_cache_enabled(True)


@pytest.mark.parametrize("spec, said", [
    ("hf:NoSuchModelForCausalLM", "has no model class 'NoSuchModelForCausalLM'"),
    ("hf:BertModel", "BertModel has none it knows; name the class with a head"),
    ("hf:BlipForConditionalGeneration", "its main input is 'pixel_values'"),
    # its vision config's sizes have names the route does not know: 656 million parameters,
    # refused before a byte is allocated
    ("hf:Qwen2VLForConditionalGeneration", "parameters as the route builds it, more than a "
                                           "tiny model's 10,000,000"),
])
def test_what_cannot_be_built_is_exit_2_with_the_reason(
        spec: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    code = main(["check", "--in-process", "--impl", "hf", "--model", spec, "--examples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, said", [
    (["--impl", "torch", "--model", "timm:vit_tiny_patch16_224"],
     "--model timm:... needs timm"),
    (["--impl", "timm", "--model", "timm:vit_tiny_patch16_224"], "needs timm"),
])
def test_the_timm_route_without_timm_says_how_to_get_it(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Where timm is not installed (the CPU build of torch has no torchvision on PyPI),
    the route is exit 2 naming the extra; tests/test_timm_route.py runs it where it is."""
    import importlib.util

    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed here")
    code = main(["check", "--in-process", *argv, "--examples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert "pip install 'gradequiv[timm]'" in err


def test_a_users_own_config_is_shrunk_with_its_switches_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hf:path/to/config.json``: the architecture a user trains (a Llama 3 8B config, as
    save_pretrained writes it), its sizes shrunk and its switches (positions, tied
    embeddings, biases) as they are, checked under transformers' own checkpointing."""
    pytest.importorskip("transformers")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rope_theta": 500000.0,
              "tie_word_embeddings": True, "mlp_bias": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.45.0", "bos_token_id": 128000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    model = build(ExternalConfig(f"hf:{path}"), Case().batch, 0).model.inner
    shrunk = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert (shrunk.hidden_size, shrunk.num_hidden_layers) == (32, 2)
    assert shrunk.tie_word_embeddings and shrunk.mlp_bias  # the user's, not the default's
    assert model.model.layers[0].mlp.up_proj.bias is not None
    assert verify(resolve("hf"), _case(str(path))).passed
    for folder in (tmp_path, path):  # the folder save_pretrained wrote, or the file
        code = main(["check", "--in-process", "--impl", "hf", "--model", f"hf:{folder}",
                     "--examples", "1", "--report-dir", str(tmp_path / "report")])
        assert code == 0, capsys.readouterr().out


def test_a_config_that_names_no_model_class_is_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    code = main(["check", "--in-process", "--impl", "hf", "--model", f"hf:{path}",
                 "--examples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "names no model class in 'architectures'" in err, err
