"""Segments that return structures with None fields, as library layers do: the reference
transformer draws them (``segment_outputs``), torch's checkpoint and a repacking peer hand
them back whole, and a checkpoint that drops the None fields fails on the field it dropped."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import find, settings
from test_diagnosis import diagnosed

from gradequiv.harness import Case, find_case, verify
from gradequiv.harness.engine.spread import load_case
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.faults import MUTANTS
from gradequiv.harness.implementations.torch_builtins import tensors_positional
from gradequiv.models import BatchConfig, TransformerConfig, build, parse_granularity
from gradequiv.models.transformer import SEGMENT_OUTPUTS, LayerOutput, LayerOutputTuple
from gradequiv.properties.strategies import cases, transformer_configs

STRUCTURES = SEGMENT_OUTPUTS[1:]
NAMED = "2L-layer-dict-outputs-aux-dropout"
_SMALL = TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=16, attn_dropout=0.1,
                           resid_dropout=0.1)
DROPPED = next(m for m in MUTANTS if m.name == "none-outputs-dropped")


def _case(kind: str, *, aux_loss: bool = True, granularity: str = "layer") -> Case:
    return Case(model=replace(_SMALL, segment_outputs=kind, aux_loss=aux_loss),
                batch=BatchConfig(2, 8), granularity=parse_granularity(granularity))


def test_the_structure_is_drawn_off_first_named_and_replayed() -> None:
    quiet = settings(database=None, max_examples=200)
    assert find(transformer_configs(), lambda c: True, settings=quiet).segment_outputs == "plain"
    drawn = find(cases(), lambda c: c.model.segment_outputs == "dict", settings=quiet)
    assert drawn.model == replace(TransformerConfig(n_embd=4, n_head=1, ffn_mult=2,
                                                    vocab_size=32, n_layer=1),
                                  segment_outputs="dict")  # all else shrunk away
    assert ", dict outputs," in drawn.describe()
    again = load_case(drawn.to_json())
    assert again == drawn and again.to_dict()["model"]["segment_outputs"] == "dict"
    assert find_case(NAMED).model.segment_outputs == "dict"


def test_each_structure_keeps_its_none_fields_and_the_model_reads_it_as_plain() -> None:
    """One model's weights under every structure: the same logits, so each is unpacked right
    (the aux loss read from its own field, not the attention weights' place)."""
    expected = {"tuple-none": tuple, "dict": dict, "dataclass": LayerOutput,
                "namedtuple": LayerOutputTuple}
    logits = {}
    for kind in SEGMENT_OUTPUTS:
        workload = build(replace(_SMALL, segment_outputs=kind, aux_loss=True), BatchConfig(2, 8),
                         0)
        model = workload.model.eval()
        block = model.blocks[0]
        x = torch.randn(2, 8, 16)
        out = block(x, x)
        if kind == "plain":
            assert isinstance(out, tuple) and len(out) == 2
        else:
            assert type(out) is expected[kind]
            attentions = out[1] if kind == "tuple-none" else (
                out["attentions"] if kind == "dict" else out.attentions)
            assert attentions is None
        logits[kind] = model(*workload.inputs)
    for kind in STRUCTURES:
        torch.testing.assert_close(logits[kind], logits["plain"], rtol=0, atol=0)


@pytest.mark.parametrize("kind", STRUCTURES)
@pytest.mark.parametrize("spec", ["torch", "torch-reentrant"])
def test_torch_s_checkpoint_hands_each_structure_back(spec: str, kind: str) -> None:
    verdict = verify(spec, _case(kind, granularity="group:2" if kind == "dataclass" else "layer"))
    assert verdict.passed and verdict.error is None, verdict.first_failure


def _plain_reentrant(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's reentrant checkpoint on the segment's tensors, its outputs as they come."""
    from torch.utils.checkpoint import checkpoint

    call, inputs = tensors_positional(function, args, kwargs)
    return checkpoint(call, *inputs, use_reentrant=True)


def test_a_reentrant_checkpoint_that_does_not_repack_loses_the_gradients_in_a_dict() -> None:
    """torch's reentrant checkpoint follows no tensor in a dict it returns: called plainly it
    gives the layers no gradient, which the run sees; torch-reentrant repacks and passes."""
    verdict = verify(Implementation("plain-reentrant", _plain_reentrant), find_case(NAMED))
    assert not verdict.passed and verdict.error is None
    assert "gradients" in {p.name for p in verdict.properties if p.passed is False}
    assert verify(Implementation("plain-reentrant", _plain_reentrant),
                  replace(find_case(NAMED), model=replace(find_case(NAMED).model,
                                                          segment_outputs="plain"))).passed


@pytest.mark.parametrize(("kind", "aux_loss", "said"), [
    ("tuple-none", True, "its item 1 (None) was dropped and the 1 after it moved up one place"),
    ("tuple-none", False, "its item 1 (None) is missing"),
    ("dict", False, "its fields 'attentions' (None) and 'router_z_loss' (None) are missing"),
    ("dataclass", True, "its None field 'attentions' was dropped: a tuple of 2 came back where "
                        "the segment returns a LayerOutput"),
    ("namedtuple", False, "its None fields 'attentions' and 'router_z_loss' were dropped: a "
                          "tuple of 1 came back where the segment returns a LayerOutputTuple"),
])
def test_dropped_none_fields_fail_naming_the_field_and_the_segment(
        kind: str, aux_loss: bool, said: str) -> None:
    verdict = verify(Implementation(DROPPED.name, DROPPED.impl), _case(kind, aux_loss=aux_loss))
    assert not verdict.passed and verdict.error is not None
    assert f"the output structure of blocks.0 changed: {said}; " in verdict.error


def test_the_headline_says_the_output_structure_changed() -> None:
    cause, sentence, _ = diagnosed(Implementation(DROPPED.name, DROPPED.impl),
                                   find_case(NAMED))
    assert cause == "output-structure"
    assert sentence.startswith("the output structure of blocks.0 changed: its field "
                               "'attentions' (None) is missing; the implementation returned "
                               "dict(hidden_states: float32[2, 8, 16], router_z_loss: float32[])"
                               " where the segment returns dict(hidden_states: float32[2, 8, 16],"
                               " attentions: None, router_z_loss: float32[])"), sentence


def _none_made_a_tensor(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's checkpoint, then the None attention weights replaced by zeros."""
    from torch.utils.checkpoint import checkpoint

    out = checkpoint(function, *args, use_reentrant=False, **kwargs)
    return {**out, "attentions": torch.zeros(1)}


def test_a_none_field_turned_into_a_tensor_is_named() -> None:
    verdict = verify(Implementation("none-made-a-tensor", _none_made_a_tensor),
                     _case("dict", aux_loss=False))
    assert verdict.error is not None
    assert ("the output structure of blocks.0 changed: its field 'attentions' is float32[1] "
            "where the segment returns None") in verdict.error
