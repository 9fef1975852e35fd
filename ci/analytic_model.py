"""Per-layer activation bytes: the op-derived model, the measured count and Korthikanti's anchor.

Usage:

    python ci/analytic_model.py > docs/analytic-model.md
"""

from __future__ import annotations

import torch

from gradequiv.harness.engine.analytic import (
    KORTHIKANTI_16BIT,
    korthikanti_bytes,
    layer_bytes,
    layer_terms,
    measured_layer_bytes,
)
from gradequiv.models import BatchConfig, TransformerConfig

WIDTH, HEADS, SEQ, BATCH = 64, 4, 64, 4  # the layer of docs/layer-sweep.md
DROPOUT = dict(attn_dropout=0.1, resid_dropout=0.1, mlp_dropout=0.1)
VARIANTS = [
    ("dropout 0.1 at every site (the layer sweep's layer)", DROPOUT),
    ("Korthikanti's layer: dropout on probabilities and residuals only",
     dict(attn_dropout=0.1, resid_dropout=0.1)),
    ("no dropout (fused CPU attention kernel)", {}),
    ("no dropout, manual attention", dict(attention="manual")),
    ("dropout everywhere, ReLU", dict(DROPOUT, activation="relu")),
    ("dropout everywhere, post-norm", dict(DROPOUT, norm_position="post")),
    ("dropout everywhere, 2x MLP", dict(DROPOUT, ffn_mult=2)),
]


def main() -> None:
    batch = BatchConfig(BATCH, SEQ, padding=False)
    sbh = SEQ * BATCH * WIDTH

    def layer(**overrides: object) -> TransformerConfig:
        fields = {"n_layer": 1, "n_embd": WIDTH, "n_head": HEADS, "max_seq_len": SEQ, **overrides}
        return TransformerConfig(**fields)  # type: ignore[arg-type]

    reference = layer(**DROPOUT)
    print("# What one layer keeps for backward: derived from its ops, measured, and the "
          "published anchor\n")
    print(f"Command: `python ci/analytic_model.py > docs/analytic-model.md`. Conditions: torch "
          f"{torch.__version__}, CPU, fp32, no autocast, training mode; the reference "
          f"transformer's layer at s={SEQ} tokens, b={BATCH}, h={WIDTH}, a={HEADS} heads "
          f"(sbh = {sbh:,} elements). Model: `gradequiv.harness.engine.analytic.layer_terms`; "
          f"measurement: the harness's own activation count over one layer "
          f"(`measured_layer_bytes`); `tests/test_analytic.py` checks that the two agree "
          f"to the byte on fixed and Hypothesis-drawn layers.\n")
    print("## The terms of the reference layer\n")
    print("| kept for backward | elements | bytes (CPU fp32) | x sbh bytes |")
    print("|---|---|---|---|")
    terms = layer_terms(reference, batch)
    for term in terms:
        print(f"| {term.what} | {term.elements:,} | {term.bytes():,} | "
              f"{term.bytes() / sbh:.3f} |")
    total = sum(t.bytes() for t in terms)
    print(f"| **total** | | **{total:,}** | **{total / sbh:.2f}** |")
    print(f"\nMeasured: **{measured_layer_bytes(reference, batch):,}** bytes.\n")

    print("## Variants, and Korthikanti et al.'s sbh(34 + 5as/h)\n")
    print("Korthikanti's count is for 16-bit activations with 1-byte dropout masks and "
          "leaves out the norms' per-token statistics. The column 'op list at 16-bit' "
          "prices this model's own terms at those sizes, statistics left out, so it "
          "equals his formula exactly where the layer is his (dropout on the attention "
          "probabilities and both residual branches, none inside the MLP, GELU, 4x MLP).\n")
    print("| layer | measured bytes | model bytes | x sbh | op list at 16-bit | "
          "Korthikanti sbh(34 + 5as/h) |")
    print("|---|---|---|---|---|---|")
    for name, overrides in VARIANTS:
        config = layer(**overrides)
        measured, modelled = measured_layer_bytes(config, batch), layer_bytes(config, batch)
        sixteen = layer_bytes(config, batch, KORTHIKANTI_16BIT) - sum(
            t.bytes(KORTHIKANTI_16BIT) for t in layer_terms(config, batch)
            if t.kind == "statistics")
        print(f"| {name} | {measured:,} | {modelled:,} | {modelled / sbh:.2f} | "
              f"{sixteen:,} | {korthikanti_bytes(config, batch):,} |")
    print("\nWhy this layer keeps more than the published count at fp32 on CPU: every "
          "activation is 4 bytes, not 2; CPU dropout keeps a noise tensor of the input's "
          "dtype (4 bytes per element) where CUDA keeps a 1-byte mask; the model has one "
          "more dropout site (inside the MLP: its noise, 4h elements per token, kept beside "
          "the dropped hidden that replaces GELU's output as the projection's input); "
          "and each LayerNorm keeps a mean and an rstd per token. "
          "Without attention dropout, torch's fused CPU kernel keeps q, k, v, its output "
          "and a logsumexp, plus the causal mask as an additive float mask, and no "
          "s x s tensor at all.")


if __name__ == "__main__":
    main()
