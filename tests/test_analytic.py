"""The analytic per-layer model against the measured count, byte for byte.

If torch changes what one of its CPU kernels keeps for backward, or the
reference model changes an op, these fail and docs/analytic-model.md is stale.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradequiv.harness.engine.analytic import (
    KORTHIKANTI_16BIT,
    korthikanti_bytes,
    layer_bytes,
    layer_terms,
    measured_layer_bytes,
)
from gradequiv.models import BatchConfig, InvalidArgument, TransformerConfig

DROPOUT_ALL = dict(attn_dropout=0.1, resid_dropout=0.1, mlp_dropout=0.1)


@pytest.mark.parametrize("overrides", [
    {}, DROPOUT_ALL, dict(DROPOUT_ALL, attention="manual"), {"attention": "manual"},
    {"attn_dropout": 0.1}, {"resid_dropout": 0.1}, {"mlp_dropout": 0.1}, {"drop_path": 0.1},
    {"activation": "relu"}, dict(DROPOUT_ALL, activation="relu"), {"norm_position": "post"},
    {"ffn_mult": 2, "n_head": 2},
], ids=repr)
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding"])
def test_terms_match_the_measured_count_exactly(overrides: dict, padding: bool) -> None:
    config = TransformerConfig(**{"n_layer": 1, "n_embd": 32, "n_head": 4, **overrides})
    batch = BatchConfig(2, 16, padding=padding)
    assert layer_bytes(config, batch) == measured_layer_bytes(config, batch)


@settings(max_examples=100, deadline=None)
@given(
    config=st.builds(
        TransformerConfig,
        n_layer=st.just(1),
        n_embd=st.sampled_from([8, 24, 48]),
        n_head=st.sampled_from([1, 2, 4]),
        ffn_mult=st.integers(1, 4),
        attn_dropout=st.sampled_from([0.0, 0.2]),
        resid_dropout=st.sampled_from([0.0, 0.2]),
        mlp_dropout=st.sampled_from([0.0, 0.2]),
        drop_path=st.sampled_from([0.0, 0.2]),
        attention=st.sampled_from(["sdpa", "manual"]),
        activation=st.sampled_from(["gelu", "relu"]),
        norm_position=st.sampled_from(["pre", "post"]),
    ),
    batch=st.builds(BatchConfig, batch_size=st.integers(1, 3), seq_len=st.integers(1, 20),
                    padding=st.booleans()),
)
def test_terms_match_on_drawn_layers(config: TransformerConfig, batch: BatchConfig) -> None:
    assert layer_bytes(config, batch) == measured_layer_bytes(config, batch)


def test_with_16_bit_sizes_the_op_list_gives_korthikanti_s_formula() -> None:
    """His standard layer: dropout after attention probabilities and both residual branches,
    none inside the MLP; his count leaves out the norms' per-token statistics."""
    config = TransformerConfig(n_layer=1, n_embd=64, n_head=4, attn_dropout=0.1,
                               resid_dropout=0.1)
    batch = BatchConfig(4, 64, padding=False)
    statistics = sum(t.bytes(KORTHIKANTI_16BIT) for t in layer_terms(config, batch)
                     if t.kind == "statistics")
    assert layer_bytes(config, batch, KORTHIKANTI_16BIT) - statistics == korthikanti_bytes(
        config, batch)


def test_unmodelled_layers_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match=r"norm='rmsnorm' is not in the analytic model"):
        layer_terms(TransformerConfig(norm="rmsnorm"), BatchConfig(1, 4))
    with pytest.raises(InvalidArgument, match=r"activation='swiglu'"):
        layer_terms(TransformerConfig(activation="swiglu"), BatchConfig(1, 4))
