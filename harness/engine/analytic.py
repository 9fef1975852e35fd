"""What one layer of the reference transformer keeps for backward, derived from its ops.

A measured byte count says how much; this says why. Each term is a tensor
that an op of ``models/transformer.py``'s ``Block`` saves for its backward,
as torch's CPU kernels do it (fp32, no autocast): a LayerNorm keeps its input
and two per-token statistics, a Linear its input, GELU its input and ReLU its
output, CPU dropout a noise tensor of the input's dtype (so 4 bytes per
element in fp32, where CUDA's keeps a 1-byte mask), SDPA with dropout runs its
math path (scaled q and k, softmax output, noise, dropped probabilities, v)
and without dropout the fused CPU kernel (q, k, v, its output, the logsumexp).
The layer's output is not counted: the next layer holds it.

Beside it, the published anchor: Korthikanti et al. (2022), a standard 16-bit
layer keeps sbh(34 + 5as/h) bytes. The tests check the terms against the
measured count exactly (``tests/test_analytic.py``), and
``ci/analytic_model.py`` writes the comparison to ``docs/analytic-model.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradequiv.harness.engine.memory import ActivationCounter
from gradequiv.harness.errors import InvalidArgument
from gradequiv.models import BatchConfig, Transformer, TransformerConfig, build

__all__ = [
    "CPU_FP32", "KORTHIKANTI_16BIT", "Term", "korthikanti_bytes", "layer_bytes", "layer_terms",
    "measured_layer_bytes",
]

#: Bytes per element of each kind of kept tensor, as torch's CPU kernels keep them in fp32:
#: dropout keeps a noise tensor of the input's dtype, a masked_fill a bool mask.
CPU_FP32 = {"activation": 4, "noise": 4, "statistics": 4, "mask": 1}
#: The element sizes of Korthikanti et al.'s count: 16-bit activations, 1-byte dropout masks.
KORTHIKANTI_16BIT = {"activation": 2, "noise": 1, "statistics": 4, "mask": 1}


@dataclass(frozen=True)
class Term:
    """One tensor a layer keeps for backward: what it is, how many elements, which kind."""

    what: str
    elements: int
    kind: str = "activation"  # a key of CPU_FP32

    def bytes(self, sizes: dict[str, int] = CPU_FP32) -> int:
        return self.elements * sizes[self.kind]


def layer_terms(config: TransformerConfig, batch: BatchConfig) -> list[Term]:
    """The tensors one layer keeps for backward, on CPU in fp32 (no autocast)."""
    _check_modelled(config)
    b, s, h = batch.batch_size, batch.seq_len, config.n_embd
    sbh, hidden = s * b * h, s * b * h * config.ffn_mult
    terms = [
        Term("norm 1 input", sbh),
        Term("norm 1 statistics (mean, rstd)", 2 * s * b, "statistics"),
        Term("attention input (norm 1 output)", sbh),
    ]
    terms += _attention_terms(config, batch)
    if config.resid_dropout > 0:
        terms.append(Term("attention residual dropout noise", sbh, "noise"))
    if config.drop_path > 0:
        terms.append(Term("attention branch drop-path keep", b, "noise"))
    terms += [
        Term("norm 2 input", sbh),
        Term("norm 2 statistics (mean, rstd)", 2 * s * b, "statistics"),
        Term("MLP input (norm 2 output)", sbh),
    ]
    if config.activation == "gelu":  # GELU keeps its input; the projection, GELU's output
        terms.append(Term("GELU input", hidden))
    elif config.mlp_dropout == 0:  # ReLU keeps its output, which is the projection's input
        terms.append(Term("ReLU output (also the MLP projection's input)", hidden))
    else:
        terms.append(Term("ReLU output", hidden))
    if config.mlp_dropout > 0:
        terms += [Term("MLP dropout noise", hidden, "noise"),
                  Term("MLP projection input (dropped)", hidden)]
    elif config.activation == "gelu":
        terms.append(Term("MLP projection input (GELU output)", hidden))
    if config.resid_dropout > 0:
        terms.append(Term("MLP residual dropout noise", sbh, "noise"))
    if config.drop_path > 0:
        terms.append(Term("MLP branch drop-path keep", b, "noise"))
    return terms


def _attention_terms(config: TransformerConfig, batch: BatchConfig) -> list[Term]:
    b, s, h, a = batch.batch_size, batch.seq_len, config.n_embd, config.n_head
    sbh, scores = s * b * h, a * s * s * b
    if config.attention == "sdpa" and config.attn_dropout == 0:
        masks = b if batch.padding else 1
        return [Term("q, k, v (the fused kernel keeps the projection's output)", 3 * sbh),
                Term("fused attention output (also the projection's input)", sbh),
                Term("fused attention logsumexp", a * s * b, "statistics"),
                Term("attention mask, as the additive float mask the kernel keeps", masks * s * s)]
    terms = [Term("q", sbh), Term("k (transposed)", sbh),
             Term("softmax output", scores)]
    if config.attention == "manual":
        masks = b if batch.padding else 1
        terms.insert(2, Term("attention mask (masked_fill)", masks * s * s, "mask"))
    if config.attn_dropout > 0:
        terms += [Term("attention dropout noise", scores, "noise"),
                  Term("attention probabilities after dropout", scores)]
    if config.attention == "sdpa" and (b == 1 or a == 1):
        # Batch and heads then fold into one dimension without a copy, so the
        # probabilities @ v matmul keeps a view of the whole projection output.
        terms.append(Term("v (a view: the whole q, k, v projection output)", 3 * sbh))
    else:
        terms.append(Term("v", sbh))
    terms.append(Term("attention projection input", sbh))
    return terms


def layer_bytes(
    config: TransformerConfig, batch: BatchConfig, sizes: dict[str, int] = CPU_FP32
) -> int:
    """Total bytes of :func:`layer_terms`, with ``sizes`` bytes per element of each kind."""
    return sum(t.bytes(sizes) for t in layer_terms(config, batch))


def korthikanti_bytes(config: TransformerConfig, batch: BatchConfig) -> int:
    """The published 16-bit estimate for one standard layer: sbh(34 + 5as/h) bytes."""
    b, s, h, a = batch.batch_size, batch.seq_len, config.n_embd, config.n_head
    return s * b * h * 34 + 5 * a * s * s * b


def _check_modelled(config: TransformerConfig) -> None:
    for name, value, modelled in (("norm", config.norm, ("layernorm",)),
                                  ("activation", config.activation, ("gelu", "relu"))):
        if value not in modelled:
            raise InvalidArgument(
                f"{name}={value!r} is not in the analytic model (it covers norm='layernorm', "
                f"activation 'gelu' or 'relu'); measure it with `gradequiv profile` instead"
            )


def measured_layer_bytes(config: TransformerConfig, batch: BatchConfig, seed: int = 0) -> int:
    """What one block keeps between its forward and backward, by the harness's own count.

    The block is called as the model calls it; its inputs, the padding mask
    and the parameters are not activations of this layer, and its output is
    held by the next layer, so none of them is counted.
    """
    workload = build(config, batch, seed, torch.device("cpu"))
    model = workload.model.train()
    assert isinstance(model, Transformer)  # built from a TransformerConfig
    block = model.blocks[0]
    shape = (batch.batch_size, batch.seq_len, config.n_embd)
    x, x0 = torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)
    mask = workload.inputs[1] if len(workload.inputs) > 1 else None
    never = [*workload.model.parameters(), x, x0, *([mask] if mask is not None else [])]
    with ActivationCounter(exclude=never) as counter:
        y = block(x, x0, mask, causal=True, residual_scale=0.5)
    return counter.held_bytes(ignore=[y])
