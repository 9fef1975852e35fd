"""Hypothesis strategies for recompute cases.

Every strategy lists its cheapest choice first (fewest layers, narrowest
width, no dropout, fp32, per-layer recompute), so a failure shrinks to a
case that is also cheap to rerun and easy to read. Most drawn cases have a
random op on: a harness that rarely turns dropout on rarely tests RNG
restoration.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.spread import compile_cases
from gradequiv.harness.errors import InvalidArgument
from gradequiv.models import (
    DRAWN_MODELS,
    DROPOUT_SITES,
    ELEMENT_DROPOUT_SITES,
    BatchConfig,
    BatchNormConfig,
    ExternalConfig,
    Granularity,
    TransformerConfig,
    parse_granularity,
)
from gradequiv.models.kinds import BATCHNORM, TRANSFORMER

__all__ = [
    "DROPOUT_SITES",
    "MODELS",
    "batch_configs",
    "batchnorm_cases",
    "cases",
    "compiled_cases",
    "dropout_regimes",
    "dtype_regimes",
    "external_cases",
    "granularities",
    "seeds",
    "transformer_configs",
]

#: Reference models a case can be drawn for (by another name, kept for callers of this module).
MODELS = DRAWN_MODELS


def _check_range(name: str, low: int, high: int, floor: int = 1) -> None:
    if not (isinstance(low, int) and isinstance(high, int)) or low < floor or high < low:
        raise InvalidArgument(
            f"min_{name}={low!r}, max_{name}={high!r}: need whole numbers with "
            f"{floor} <= min_{name} <= max_{name}"
        )


def _regime(choice: int, site: str, p: float) -> dict[str, float]:
    every = dict.fromkeys(ELEMENT_DROPOUT_SITES, 0.1)
    if choice == 0:
        return {}
    if choice <= 3:
        return {site: p}
    if choice <= 5:
        return every
    return {s: max(p, 0.3) for s in every}


def dropout_regimes(*, max_p: float = 0.5) -> st.SearchStrategy[dict[str, float]]:
    """Return a strategy for dropout settings: config fields mapped to probabilities.

    Regimes, in shrink order: off (one draw in eight), one random site (three
    in eight; drop-path among them), every element-wise dropout site at 0.1,
    every one at a high p (0.3 up to ``max_p``). A failure shrinks towards
    off, else one site at p = 0.1.
    """
    if not 0.1 <= max_p < 1.0:
        raise InvalidArgument(f"max_p={max_p!r}: must be in [0.1, 1)")
    rates = sorted({0.1, 0.2, min(0.5, max_p), max_p})
    return st.builds(_regime, st.integers(0, 7), st.sampled_from(tuple(DROPOUT_SITES)),
                     st.sampled_from(rates))


@st.composite
def transformer_configs(
    draw: st.DrawFn,
    *,
    min_layers: int = 1,
    max_layers: int = 4,
    max_width: int = 128,
    dropout: st.SearchStrategy[dict[str, float]] | None = None,
) -> TransformerConfig:
    """Return a strategy for reference-transformer configurations.

    Width is ``n_head * head_dim`` (heads 1, 2, 4; head size 4 to 32) up to
    ``max_width``. Every knob of the model is drawn: attention path, norm and
    its placement, activation, tied embeddings, bias, dropout
    (``dropout_regimes()`` by default). Shrinks towards one layer, one head of
    width 4, SDPA, pre-LayerNorm, GELU.
    """
    _check_range("layers", min_layers, max_layers)
    if max_width < 4:
        raise InvalidArgument(f"max_width={max_width!r}: must be at least 4")
    # Config field names known only at run time: the ** below cannot be checked per field.
    rates: dict[str, Any] = draw(dropout if dropout is not None else dropout_regimes())
    n_layer = draw(st.integers(min_layers, max_layers))
    n_head = draw(st.sampled_from([h for h in (1, 2, 4) if 4 * h <= max_width]))
    head_dim = draw(st.sampled_from([d for d in (4, 8, 16, 32) if n_head * d <= max_width]))
    return TransformerConfig(
        n_layer=n_layer,
        n_embd=n_head * head_dim,
        n_head=n_head,
        ffn_mult=draw(st.sampled_from([2, 4])),
        vocab_size=draw(st.sampled_from([32, 64, 256])),
        max_seq_len=64,
        attention=draw(st.sampled_from(["sdpa", "manual"])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        norm_position=draw(st.sampled_from(["pre", "post"])),
        activation=draw(st.sampled_from(["gelu", "relu", "swiglu", "rrelu"])),
        tie_embeddings=draw(st.booleans().map(lambda b: not b)),
        bias=draw(st.booleans().map(lambda b: not b)),
        **rates,
    )


def dtype_regimes(*, device: str = "cpu") -> st.SearchStrategy[str]:
    """Return a strategy for precision regimes: fp32 and bf16 autocast; fp16 too on CUDA.

    Shrinks towards fp32.
    """
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(f"device={device!r}: must be 'cpu' or 'cuda'")
    regimes = ["fp32", "bf16-autocast"] + (["fp16-autocast"] if device == "cuda" else [])
    return st.sampled_from(regimes)


def granularities(*, n_layers: int, include_none: bool = False) -> st.SearchStrategy[Granularity]:
    """Return a strategy for which segments recompute in a model of ``n_layers`` layers.

    Shrinks towards per-layer recompute; ``none`` (nothing recomputed) only
    with ``include_none=True``, as it cannot fail.
    """
    _check_range("layers", n_layers, n_layers)
    kinds = ["layer", "attention", "mlp"]
    if n_layers > 1:
        kinds += [f"every:{k}" for k in range(2, n_layers + 1)]
        kinds += [f"group:{k}" for k in range(2, n_layers + 1)]
    if include_none:
        kinds.append("none")
    return st.sampled_from(kinds).map(parse_granularity)


def batch_configs(*, max_batch: int = 4, max_seq_len: int = 32) -> st.SearchStrategy[BatchConfig]:
    """Return a strategy for the fixed batch's shape and padding.

    Shrinks towards 1 sequence of 1 token without padding.
    """
    _check_range("batch", 1, max_batch)
    _check_range("seq_len", 1, max_seq_len)
    return st.builds(
        BatchConfig,
        batch_size=st.integers(1, max_batch),
        seq_len=st.integers(1, max_seq_len),
        padding=st.booleans(),
    )


def seeds() -> st.SearchStrategy[int]:
    """Return a strategy for the seed of weights, batch and random stream; shrinks to 0."""
    return st.integers(0, 2**16 - 1)


@st.composite
def batchnorm_cases(draw: st.DrawFn, *, device: str = "cpu") -> Case:
    """Return a strategy for cases of the BatchNorm model (the buffers property's model).

    Shrinks towards one layer, width 8, no dropout, two samples, fp32.
    """
    n_layer = draw(st.integers(1, 3))
    model = BatchNormConfig(n_layer=n_layer, width=draw(st.sampled_from([8, 16, 32])),
                            dropout=draw(st.sampled_from([0.0, 0.1, 0.3])))
    granularity = draw(st.sampled_from(
        ["layer"] + [f"every:{k}" for k in range(2, n_layer + 1)]).map(parse_granularity))
    return Case(model=model, batch=BatchConfig(batch_size=draw(st.integers(2, 8)), seq_len=1),
                granularity=granularity, dtype=draw(dtype_regimes(device=device)),
                seed=draw(seeds()))


def external_cases(factory: str, *, device: str = "cpu") -> st.SearchStrategy[Case]:
    """Return a strategy for cases of a user's model (``--model``): the factory fixes the
    model and batch; drawn are the granularity (every segment, or every 2nd), the precision
    regime and the seed. Shrinks towards every segment, fp32, seed 0.
    """
    model = ExternalConfig(factory)
    return st.builds(Case, model=st.just(model),
                     granularity=st.sampled_from(["layer", "every:2"]).map(parse_granularity),
                     dtype=dtype_regimes(device=device), seed=seeds())


def compiled_cases(*, device: str = "cpu") -> st.SearchStrategy[Case]:
    """Return a strategy for cases of compiled implementations: a model of the compile
    spread (whose graphs are then compiled already), with a drawn precision and seed.
    Shrinks towards the model without dropout, fp32, seed 0.
    """
    return st.builds(lambda case, dtype, seed: replace(case, dtype=dtype, seed=seed, name=""),
                     st.sampled_from(compile_cases()), dtype_regimes(device=device), seeds())


@st.composite
def cases(
    draw: st.DrawFn,
    /,
    *,
    device: str = "cpu",
    models: tuple[str, ...] = (TRANSFORMER,),
    max_layers: int = 4,
    max_width: int = 128,
    max_seq_len: int = 32,
    **config_kwargs: Any,
) -> Case:
    """Return a strategy for whole cases: model, batch, granularity, dtype, seed.

    ``models`` picks the reference models drawn from (``MODELS``); the
    default leaves out the BatchNorm model, whose running statistics torch's
    own checkpoint updates twice. The largest transformer cases (4 layers x
    128 wide x 32 tokens x 4 sequences) give segment inputs of 16k elements.
    Shrinks towards the cheapest case of the first model.
    """
    unknown = set(models) - set(MODELS)
    if not models or unknown:
        raise InvalidArgument(
            f"models={models!r}: pick one or more of {', '.join(MODELS)}"
        )
    kind = draw(st.sampled_from(models))
    if kind == BATCHNORM:
        return draw(batchnorm_cases(device=device))
    model = draw(transformer_configs(max_layers=max_layers, max_width=max_width,
                                     **config_kwargs))
    return Case(
        model=model,
        batch=draw(batch_configs(max_seq_len=max_seq_len)),
        granularity=draw(granularities(n_layers=model.n_layer)),
        dtype=draw(dtype_regimes(device=device)),
        seed=draw(seeds()),
    )
