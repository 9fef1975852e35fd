"""Hypothesis strategies for recompute cases.

Every strategy lists its cheapest choice first (fewest layers, narrowest
width, no dropout, fp32, per-layer recompute), so a failure shrinks to a
case that is also cheap to rerun and easy to read. Most drawn cases have a
random op on: a harness that rarely turns dropout on rarely tests RNG
restoration.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.parallel import Parallel
from gradequiv.harness.engine.schedules import PIPELINE_SCHEDULES, Pipelining
from gradequiv.harness.engine.spread import compile_cases
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.regime import EVERYTHING, Regime
from gradequiv.models import (
    DRAWN_MODELS,
    DROPOUT_SITES,
    ELEMENT_DROPOUT_SITES,
    BatchConfig,
    BatchNormConfig,
    ExternalConfig,
    Granularity,
    LayerGroups,
    TransformerConfig,
    parse_granularity,
)
from gradequiv.models.kinds import (
    BATCHNORM,
    DTYPES,
    GRAD_MODES,
    SCHEDULE_MICRO_BATCHES,
    SCHEDULES,
    TRAINABLE,
    TRANSFORMER,
)
from gradequiv.models.transformer import SEGMENT_OUTPUTS

__all__ = [
    "DROPOUT_SITES",
    "MODELS",
    "batch_configs",
    "batchnorm_cases",
    "cases",
    "compiled_cases",
    "distributed_cases",
    "distributed_runs",
    "dropout_regimes",
    "dtype_regimes",
    "external_cases",
    "grad_modes",
    "granularities",
    "training_loops",
    "seeds",
    "transformer_configs",
]

#: Reference models a case can be drawn for (by another name, kept for callers of this module).
MODELS = DRAWN_MODELS

# Every strategy below is built once per set of arguments and kept: a strategy is immutable,
# and Hypothesis validates each new one on its first draw, which made up a third of a
# case's draw (shrinking draws hundreds of cases). Kept ones draw exactly the same choices.
_cached = functools.lru_cache(maxsize=None)


@_cached
def _one_of(options: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(options)


_BOOLEANS = st.booleans()
#: What each layer returns: plain in one draw of two, else one of the structures with None
#: fields; both choices made always, so they keep their places while shrinking.
_SEGMENT_OUTPUTS = st.tuples(st.booleans(), st.sampled_from(SEGMENT_OUTPUTS[1:])).map(
    lambda drawn: drawn[1] if drawn[0] else SEGMENT_OUTPUTS[0])
#: Experts per token under a mixture of experts: a dense MLP (0) first and in seven draws
#: of eight (a routed layer runs ten times the ops of a dense one: at one in four a default
#: check took 1.5 times as long), top-1 or top-2 routing in the rest; two named cases route.
_MOE_TOP_K = st.sampled_from((0,) * 14 + (1, 2))
_integers = _cached(st.integers)
_TRUE_FIRST = st.booleans().map(lambda b: not b)  # shrinks towards True


@_cached
def _granularity_of(kinds: tuple[str, ...]) -> st.SearchStrategy[Granularity]:
    return st.sampled_from(kinds).map(parse_granularity)


def _layer_or_every(n_layer: int) -> st.SearchStrategy[Granularity]:
    return _granularity_of(("layer", *(f"every:{k}" for k in range(2, n_layer + 1))))


@_cached
def _kept_call(factory: Any, kwargs: tuple[tuple[str, Any], ...]) -> Any:
    return factory(**dict(kwargs))


def _kept(factory: Any, **kwargs: Any) -> Any:
    """``factory(**kwargs)``, the strategy built once per arguments where they hash."""
    try:
        return _kept_call(factory, tuple(sorted(kwargs.items())))
    except TypeError:  # an unhashable argument: built anew
        return factory(**kwargs)


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


@_cached
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
    (``dropout_regimes()`` by default), and the shapes real layers have: an
    auxiliary loss beside the hidden state (a tuple out of each layer), each layer
    applied twice (weight sharing), ``x0`` by keyword, running statistics kept in
    buffers (counters compared exactly), tensors nested in containers with none
    positional, in-place ops, value-changing hooks (LoRA, input rescale, steering) and
    parameters read from outside the segment's module; and, drawn first, the structure
    each layer returns its hidden state in (a tuple, dict, dataclass or named tuple with
    None fields, in one draw of two) and a mixture of experts in place of each MLP (top-1
    or top-2 routing). Shrinks towards plain outputs, dense MLPs, one layer, one
    head of width 4, SDPA, pre-LayerNorm, GELU, one tensor out, each layer once, no
    buffers, plain positional inputs, no in-place ops, no hooks, no outside parameters.
    """
    _check_range("layers", min_layers, max_layers)
    if max_width < 4:
        raise InvalidArgument(f"max_width={max_width!r}: must be at least 4")
    # First, so that the shrinker takes it off first: what a failure does not need goes.
    segment_outputs: Any = draw(_SEGMENT_OUTPUTS)  # one of the config's Literal values
    moe_top_k = draw(_MOE_TOP_K)
    # Config field names known only at run time: the ** below cannot be checked per field.
    rates: dict[str, Any] = draw(dropout if dropout is not None else dropout_regimes())
    n_layer = draw(_integers(min_layers, max_layers))
    n_head = draw(_one_of(tuple(h for h in (1, 2, 4) if 4 * h <= max_width)))
    head_dim = draw(_one_of(tuple(d for d in (4, 8, 16, 32) if n_head * d <= max_width)))
    return TransformerConfig(
        n_layer=n_layer,
        n_embd=n_head * head_dim,
        n_head=n_head,
        ffn_mult=draw(_one_of((2, 4))),
        vocab_size=draw(_one_of((32, 64, 256))),
        max_seq_len=64,
        attention=draw(_one_of(("sdpa", "manual"))),
        norm=draw(_one_of(("layernorm", "rmsnorm"))),
        norm_position=draw(_one_of(("pre", "post"))),
        activation=draw(_one_of(("gelu", "relu", "swiglu", "rrelu"))),
        tie_embeddings=draw(_TRUE_FIRST),
        bias=draw(_TRUE_FIRST),
        aux_loss=draw(_BOOLEANS),
        layer_repeats=draw(_one_of((1, 2))),
        x0_keyword=draw(_BOOLEANS),
        running_stats=draw(_BOOLEANS),
        nested_inputs=draw(_BOOLEANS),
        inplace_ops=draw(_BOOLEANS),
        value_hooks=draw(_BOOLEANS),
        outside_params=draw(_BOOLEANS),
        segment_outputs=segment_outputs,
        moe_top_k=moe_top_k,
        **rates,
    )


#: The one large model a case may be drawn at: segment inputs of 4 x 128 x 256 = 128K
#: elements, above the 64K where real implementations switch to other paths (compressing
#: or partitioning big boundaries), in one layer so that it stays cheap.
LARGE = TransformerConfig(n_layer=1, n_embd=256, n_head=4, max_seq_len=128)
LARGE_BATCH = BatchConfig(batch_size=4, seq_len=128)
#: The long batch a case may be drawn at: more sequences than the usual 4 (up to 16) and
#: longer ones (up to 64 tokens), where implementations that special-case a size go wrong.
LONG_BATCH = (4, 16)
LONG_SEQ_LEN = 64


@_cached
def dtype_regimes(*, device: str = "cpu",
                  dtypes: tuple[str, ...] = DTYPES) -> st.SearchStrategy[str]:
    """Return a strategy for precision regimes: fp32, bf16 and fp16 autocast (a recompute
    must re-enter the caller's autocast dtype, not the device's default), and the model
    itself in bf16; those among ``dtypes`` only (a stated training regime's). Every one
    runs on either device. Shrinks towards fp32.
    """
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(f"device={device!r}: must be 'cpu' or 'cuda'")
    kept = [d for d in DTYPES if d in dtypes]
    if not kept:
        raise InvalidArgument(f"dtypes={dtypes!r}: pick one or more of {', '.join(DTYPES)}")
    return st.sampled_from(kept)


@_cached
def grad_modes(modes: tuple[str, ...] = GRAD_MODES) -> st.SearchStrategy[str]:
    """Return a strategy for how each step asks for gradients, among ``modes`` (an
    implementation's own: ``Implementation.grad_modes``). Shrinks towards
    ``loss.backward()``."""
    unknown = set(modes) - set(GRAD_MODES)
    if not modes or unknown:
        raise InvalidArgument(f"grad modes {modes!r}: pick one or more of {', '.join(GRAD_MODES)}")
    return st.sampled_from([m for m in GRAD_MODES if m in modes])


#: Of every _OFF + 1 drawn cases, _OFF have a training-loop dimension at its plain value:
#: one in four has a schedule, one in four a loss in parts, and so on (a schedule costs its
#: 4 or 6 micro-batches), and a failure shrinks them off.
_OFF = 3


@_cached
def _one_in_four(plain: Any, others: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """``plain`` in _OFF draws of _OFF + 1, else one of ``others``; both draws made always,
    so the choices keep their places while shrinking; shrinks towards ``plain``."""
    return st.tuples(st.integers(0, _OFF), st.sampled_from(others)).map(
        lambda drawn: drawn[1] if drawn[0] == _OFF else plain)


@st.composite
def training_loops(draw: st.DrawFn, *, mode: str = "backward", dtype: str = "fp32",
                   trainable: tuple[str, ...] = TRAINABLE,
                   schedules: tuple[str, ...] = SCHEDULES,
                   regime: Regime = EVERYTHING) -> dict[str, Any]:
    """Return a strategy for how a training loop drives the segments, as ``Case`` fields:
    a micro-batch schedule (GPipe, reversed, 1F1B with four in flight, one backward of the
    summed losses; only where ``mode`` asks for one backward per forward), the loss in
    2 or 3 parts backpropagated in turn (not under a gradient penalty), the backward inside
    autocast, and which parameters train (among ``trainable``). Each is off in three draws
    of four and shrinks towards off. Within ``regime``: its schedules (every case has one
    where the regime has no whole-batch step), at most its loss parts, its backward."""
    # Every choice is drawn whatever the others are, and one that cannot be is taken as off:
    # the draws keep their places while shrinking changes what came before them.
    plain = mode in ("backward", "autograd-grad")
    schedule = draw(_one_in_four("one", SCHEDULES[1:]))
    passes = draw(_one_in_four(1, (2, 3)))
    chosen = draw(_one_in_four("all", TRAINABLE[1:]))
    loop: dict[str, Any] = {
        "schedule": schedule if plain and schedule in schedules else "one",
        "backward_passes": passes if mode != "create-graph" else 1,
        "backward_autocast": draw(_one_in_four(False, (True,))),
        "trainable": chosen if chosen in trainable else "all",
    }
    if not dtype.endswith("-autocast") and dtype != "fp32":
        loop["backward_autocast"] = False  # a bf16 model under bf16 autocast: no new state
    return _within(regime, loop, plain=plain, dtype=dtype,
                   schedules=tuple(s for s in SCHEDULES[1:] if s in schedules), draw=draw)


def _within(regime: Regime, loop: dict[str, Any], *, plain: bool, dtype: str,
            schedules: tuple[str, ...], draw: st.DrawFn) -> dict[str, Any]:
    """``loop`` moved into the stated training regime: a schedule it runs (drawn among them
    where it has no whole-batch step), no more loss parts than it splits, its backward."""
    if not regime.stated:
        return loop
    stated = tuple(s for s in schedules if s in regime.schedules)
    if loop["schedule"] not in regime.schedules:
        loop["schedule"] = "one"
    if "one" not in regime.schedules and plain and stated:
        # drawn always, so the draws after it keep their places while shrinking
        picked = draw(_one_of(stated))
        loop["schedule"] = loop["schedule"] if loop["schedule"] != "one" else picked
    loop["backward_passes"] = min(loop["backward_passes"], regime.loss_parts)
    allowed = regime.backward_autocast()
    if loop["backward_autocast"] not in allowed and (dtype.endswith("-autocast")
                                                     or loop["backward_autocast"]):
        loop["backward_autocast"] = allowed[0] if dtype.endswith("-autocast") else False
    return loop


@_cached
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
    return _granularity_of(tuple(kinds))


@_cached
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


@_cached
def seeds() -> st.SearchStrategy[int]:
    """Return a strategy for the seed of weights, batch and random stream; shrinks to 0."""
    return st.integers(0, 2**16 - 1)


@st.composite
def batchnorm_cases(draw: st.DrawFn, *, device: str = "cpu",
                    modes: tuple[str, ...] = GRAD_MODES, regime: Regime = EVERYTHING) -> Case:
    """Return a strategy for cases of the BatchNorm model (the buffers property's model).

    Accumulation is drawn only with 4 samples or more (2 per micro-batch, as BatchNorm
    needs). Shrinks towards one layer, width 8, no dropout, no in-place ops, two samples,
    fp32.
    """
    modes = regime.modes_within(modes)
    n_layer = draw(_integers(1, 3))
    model = BatchNormConfig(n_layer=n_layer, width=draw(_one_of((8, 16, 32))),
                            dropout=draw(_one_of((0.0, 0.1, 0.3))),
                            inplace_ops=draw(_BOOLEANS))
    granularity = draw(_layer_or_every(n_layer))
    batch_size = draw(_integers(2, 8))
    mode = draw(grad_modes(modes))
    mode = mode if mode != "accumulate" or batch_size >= 4 else "backward"
    dtype = draw(dtype_regimes(device=device, dtypes=regime.dtypes))
    seed = draw(seeds())
    inference = draw(_BOOLEANS)
    # No schedule: BatchNorm needs 2 samples in each of its micro-batches
    loop = draw(_kept(training_loops, mode=mode, dtype=dtype,
                      trainable=("frozen-layer", "changing"), schedules=(), regime=regime))
    return Case(model=model, batch=BatchConfig(batch_size=batch_size, seq_len=1),
                granularity=granularity, dtype=dtype, seed=seed, grad_mode=mode,
                inference=inference, **loop)


def external_cases(factory: str, *, device: str = "cpu",
                   modes: tuple[str, ...] = GRAD_MODES,
                   toggle_chooses: bool = False,
                   regime: Regime = EVERYTHING) -> st.SearchStrategy[Case]:
    """Return a strategy for cases of a user's model (``--model``): the factory fixes the
    model, its batch and the precision regimes it runs (``UserModel.regimes``); drawn are
    the granularity (every segment, or every 2nd; with
    ``toggle_chooses``, a toggle that picks its own segments, only "the toggle's"), the
    precision regime, the seed, how gradients are asked for and the forwards before
    training. Shrinks towards every segment, fp32, seed 0, ``loss.backward()``; never a
    gradient penalty (``create-graph``).
    """
    from gradequiv.models.external import declared_regimes

    model = ExternalConfig(factory)
    declared = declared_regimes(factory)  # the factory's own list: only those are drawn
    dtypes = dtype_regimes(device=device, dtypes=regime.dtypes_within(declared, factory))
    # Not a gradient penalty: a user's model need not be twice differentiable (fused
    # attention kernels have no double backward).
    modes = tuple(m for m in regime.modes_within(modes) if m != "create-graph")
    @st.composite
    def one(draw: st.DrawFn) -> Case:
        granularity = draw(_granularity_of(("toggle",) if toggle_chooses
                                          else ("layer", "every:2")))
        dtype, seed, mode = draw(dtypes), draw(seeds()), draw(grad_modes(modes))
        inference = draw(_BOOLEANS)
        # the schedules and the loss in parts; which parameters train is the factory's
        loop = draw(_kept(training_loops, mode=mode, dtype=dtype, trainable=(),
                          regime=regime))
        if not dtype.endswith("-autocast"):  # the model's regimes say what it runs in
            loop["backward_autocast"] = False
        return Case(model=model, granularity=granularity, dtype=dtype, seed=seed,
                    grad_mode=mode, inference=inference, **loop)

    return one()


def compiled_cases(*, device: str = "cpu", regime: Regime = EVERYTHING) -> st.SearchStrategy[Case]:
    """Return a strategy for cases of compiled implementations: a model of the compile
    spread (whose graphs are then compiled already), with a drawn precision and seed.
    The precisions are fp32 and bf16 autocast, the two the compiled floor is calibrated
    for. Shrinks towards the model without dropout, fp32, seed 0.
    """
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(f"device={device!r}: must be 'cpu' or 'cuda'")
    precisions = [d for d in ("fp32", "bf16-autocast") if d in regime.dtypes]
    if not precisions:
        raise InvalidArgument(
            f"a compiled implementation is checked in fp32 and bf16-autocast, and the training "
            f"regime ({regime.source}) states dtypes {', '.join(regime.dtypes)}; state one "
            f"of those two")
    spread = [c for c in compile_cases() if not regime.outside(replace(c, dtype=precisions[0]))]
    if not spread:
        raise InvalidArgument(
            f"the training regime ({regime.source}) leaves out every case of the compile "
            f"spread (one batch per step, one backward, gradients by loss.backward()); state "
            f"schedules=one and grad-modes=backward among what it runs")
    return st.builds(lambda case, dtype, seed: replace(case, dtype=dtype, seed=seed, name=""),
                     st.sampled_from(spread),
                     st.sampled_from(precisions), seeds())


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
    modes: tuple[str, ...] = GRAD_MODES,
    regime: Regime = EVERYTHING,
    **config_kwargs: Any,
) -> Case:
    """Return a strategy for whole cases: model, batch, granularity, dtype, seed, how
    gradients are asked for (among ``modes``; a gradient penalty with the manual attention
    path, as SDPA's fused kernels have no double backward), and whether an eval and a
    no_grad forward come before training. Under autocast the last layer may run with
    autocast disabled (``fp32_last_layer``); with two layers or more, outside layer groups,
    the first may run under ``no_grad`` (``frozen_first_layer``), drawn last.

    ``models`` picks the reference models drawn from (``MODELS``); the
    default leaves out the BatchNorm model, whose running statistics torch's
    own checkpoint updates twice. Transformer cases are drawn up to 4 layers x
    128 wide x 32 tokens x 4 sequences (segment inputs of 16k elements); one in
    eight is a long batch instead (5 to 16 sequences of 33 to 64 tokens, on at most
    two layers) and one in eight the one-layer ``LARGE`` model (128k elements). Shrinks
    towards the cheapest case of the first model; a fault that only shows above a
    size keeps its case large, as the shrinker keeps only cases that still fail.
    """
    unknown = set(models) - set(MODELS)
    if not models or unknown:
        raise InvalidArgument(
            f"models={models!r}: pick one or more of {', '.join(MODELS)}"
        )
    modes = regime.modes_within(modes)
    kind = draw(_one_of(tuple(models)))
    if kind == BATCHNORM:
        drawn: Case = draw(_kept(batchnorm_cases, device=device, modes=modes, regime=regime))
        return drawn
    model = draw(_kept(transformer_configs, max_layers=max_layers, max_width=max_width,
                       **config_kwargs))
    batch = draw(batch_configs(max_seq_len=max_seq_len))
    size = draw(_integers(0, 7))
    if size == 7:  # the large size: this model's knobs, the large shape
        model = replace(model, n_layer=LARGE.n_layer, n_embd=LARGE.n_embd,
                        n_head=LARGE.n_head, max_seq_len=LARGE.max_seq_len)
        batch = replace(LARGE_BATCH, padding=batch.padding)
    elif size == 6:  # a long batch: more and longer sequences, on at most two layers
        shortest = min(max_seq_len, LONG_SEQ_LEN - 1) + 1
        batch = replace(batch, batch_size=draw(_integers(LONG_BATCH[0] + 1, LONG_BATCH[1])),
                        seq_len=draw(_integers(shortest, max(LONG_SEQ_LEN, shortest))))
        model = replace(model, n_layer=min(model.n_layer, 2),
                        max_seq_len=max(model.max_seq_len, batch.seq_len))
    dtype = draw(dtype_regimes(device=device, dtypes=regime.dtypes))
    if dtype != "fp32":
        # A weight used twice under a low precision: full storage sums both uses' gradients
        # in that precision on autocast's one cached cast, a recompute that casts per use
        # sums them in fp32 (or in another order). Both are right; they differ by rounding.
        model = replace(model, layer_repeats=1)
    if dtype.endswith("-autocast"):
        # The last layer under autocast(enabled=False) inside the autocast forward: the
        # autocast state differs between segments of one forward.
        model = replace(model, fp32_last_layer=draw(_BOOLEANS))
    granularity = draw(granularities(n_layers=model.n_layer))
    seed = draw(seeds())
    mode = draw(grad_modes(modes))
    if mode == "create-graph":  # SDPA's fused kernels have no double backward
        model = replace(model, attention="manual")
    inference = draw(_BOOLEANS)
    if model.n_layer > 1 and not isinstance(granularity, LayerGroups):
        # The first layer under no_grad (frozen) while the rest trains: grad mode differs
        # between the segments of one forward. Not inside a group, where the frozen layer
        # is no segment of its own and the group's grad mode does not change.
        model = replace(model, frozen_first_layer=draw(_BOOLEANS))
    loop = draw(_kept(training_loops, mode=mode, dtype=dtype, trainable=(
        "frozen-layer", "changing", *(("adapters",) if model.value_hooks else ())),
        regime=regime))
    if loop["schedule"] != "one":  # a row for each micro-batch, so that they all differ
        batch = replace(batch, batch_size=max(batch.batch_size,
                                              SCHEDULE_MICRO_BATCHES[loop["schedule"]]))
    return Case(
        model=model,
        batch=batch,
        granularity=granularity,
        dtype=dtype,
        seed=seed,
        grad_mode=mode,
        inference=inference,
        **loop,
    )


#: FSDP2's reshard modes a distributed case is drawn with, in shrink order (2: reshard to
#: groups of two ranks after forward, where that divides the world size)
RESHARD_MODES: tuple[bool | int, ...] = (True, False, 2)


@_cached
def distributed_cases(*, world_size: int = 2,
                      engines: tuple[str, ...] = ("ddp", "fsdp", "tp"),
                      model: str | None = None, device: str = "cpu",
                      model_parallel: bool = False, schedules: tuple[str, ...] | None = None,
                      split: str | None = None, regime: Regime = EVERYTHING
                      ) -> st.SearchStrategy[tuple[Case, Parallel]]:
    """Return a strategy for cases trained on ``world_size`` ranks, with their engine: the
    cases :func:`cases` (or :func:`external_cases` of ``model``) draws, trained one
    forward and one ``loss.backward()`` a step with every parameter training, at least a
    sample a rank; the engine among ``engines`` and, under FSDP2, its reshard mode and
    whether its mixed-precision policy is on (``model_parallel``: the user's set-up shares
    rows across every rank; ``split``: the function that cuts ``model`` into pipeline
    stages, without which its pipeline is DDP; ``regime``: the training regime stated,
    whose precisions, backward, pipeline micro-batches are drawn only). Shrinks towards
    the first engine, resharding after forward, full precision and the cheapest case."""
    if world_size < 2:
        raise InvalidArgument(f"world_size={world_size!r}: at least 2 ranks")
    # one loss.backward() a step, whatever grad modes and schedules the regime states
    within = Regime(dtypes=regime.dtypes, backward=regime.backward, source=regime.source)
    drawn = (external_cases(model, device=device, modes=("backward",), regime=within)
             if model is not None else cases(device=device, modes=("backward",),
                                              regime=within))

    def trained_so(case: Case) -> Case:
        config = case.model
        if isinstance(config, TransformerConfig):  # every parameter trains under DDP
            config = replace(config, frozen_first_layer=False)
        rows = max(case.batch.batch_size, world_size)
        return replace(case, model=config, schedule="one", backward_passes=1,
                       backward_autocast=False, trainable="all", inference=False,
                       batch=replace(case.batch, batch_size=rows))

    def sequence(name: str) -> st.SearchStrategy[bool]:
        return st.booleans() if Parallel(name).splits_layers else st.just(False)

    def sharded(name: str) -> st.SearchStrategy[Parallel]:
        shards = world_size // Parallel(name).tensor_parallel(world_size)
        modes = tuple(m for m in RESHARD_MODES if isinstance(m, bool) or shards % m == 0)
        return st.tuples(_one_of(modes), st.booleans(), sequence(name)).map(
            lambda drawn: Parallel(name, drawn[0], drawn[1], sequence_parallel=drawn[2]))

    def plain(name: str) -> st.SearchStrategy[Parallel]:
        return sequence(name).map(lambda split: Parallel(
            name, model_parallel=model_parallel and name == "user", sequence_parallel=split))

    def piped() -> st.SearchStrategy[Parallel]:
        return pipelines(world_size, schedules, regime.micro_batches).map(
            lambda pipe: Parallel("pp", pipeline=replace(pipe, split=split)))

    def engine_of(name: str) -> st.SearchStrategy[Parallel]:
        if name == "pp":
            return piped()
        return sharded(name) if Parallel(name).sharded else plain(name)

    engine = _one_of(engines).flatmap(engine_of)
    return st.tuples(drawn.map(trained_so), engine).map(
        lambda pair: _fit_engine(pair, world_size))


@_cached
def pipelines(world_size: int = 2, schedules: tuple[str, ...] | None = None,
              micro_batches: int | None = None) -> st.SearchStrategy[Pipelining]:
    """Return a strategy for how a case is trained through torch's pipeline schedules on
    ``world_size`` ranks: the schedule (every one torch 2.13 has; GPipe first, as it
    shrinks), the stages each rank holds (the schedule's own number) and the micro-batches:
    one or two per rank under one stage per rank, one per stage under several.
    ``schedules``: those only (the one a user trains with); ``micro_batches``: that many
    always (the user's own number)."""
    def micro(schedule: str) -> st.SearchStrategy[Pipelining]:
        if micro_batches is not None:
            return st.just(Pipelining(schedule, micro_batches))
        one = Pipelining(schedule, 1)
        if one.per_rank == 1:
            return _one_of((world_size, 2 * world_size)).map(
                lambda n: Pipelining(schedule, n))
        return st.just(Pipelining(schedule, one.n_stages(world_size)))

    return _one_of(schedules or tuple(PIPELINE_SCHEDULES)).flatmap(micro)


@_cached
def distributed_runs(*, max_world_size: int = 2,
                     engines: tuple[str, ...] = ("ddp", "fsdp", "tp", "fsdp-tp", "pp"),
                     model: str | None = None, device: str = "cpu",
                     model_parallel: bool = False, schedules: tuple[str, ...] | None = None,
                     split: str | None = None, regime: Regime = EVERYTHING
                     ) -> st.SearchStrategy[tuple[Case, Parallel, int]]:
    """Return a strategy for a case, its engine and its world size, 2 to ``max_world_size``
    ranks: :func:`distributed_cases` on a world size drawn first, with the engines of
    ``engines`` that many ranks can form (tensor parallelism on an even number; the 2-D
    mesh on pairs of pairs). Shrinks towards the fewest ranks, then as that does."""
    if max_world_size < 2:
        raise InvalidArgument(f"max_world_size={max_world_size!r}: at least 2 ranks")

    def usable(world: int) -> tuple[str, ...]:
        return tuple(e for e in engines if e == "pp" or Parallel(e).tensor_parallel(world) == 1
                     or (world % 2 == 0 and (e != "fsdp-tp" or world >= 4)))

    def on(world: int) -> st.SearchStrategy[tuple[Case, Parallel, int]]:
        return distributed_cases(world_size=world, engines=usable(world), model=model,
                                 device=device, model_parallel=model_parallel,
                                 schedules=schedules, split=split, regime=regime
                                 ).map(lambda drawn: (*drawn, world))

    worlds = [w for w in range(2, max_world_size + 1) if usable(w)]
    if not worlds:
        raise InvalidArgument(f"engines={engines!r}: none can run on 2 to {max_world_size} "
                              f"ranks")
    return _one_of(tuple(worlds)).flatmap(on)


def _fit_engine(drawn: tuple[Case, Parallel], world_size: int = 2) -> tuple[Case, Parallel]:
    """The case as the engine can train it: tensor parallelism hands the sharded MLP's
    output on as a view of a DTensor's local tensor, which autograd refuses to see changed
    in place (the model's in-place dropout and ReLU: Megatron-style code has none there);
    FSDP2's bf16 policy is the case's precision (an autocast or a cast model beside it
    meets bf16 parameters with other dtypes, which torch's CPU kernels refuse); sequence
    parallelism splits the norm that feeds the MLP, which only pre-norm layers have, and
    hands the MLP a DTensor, which a plain buffer's running statistics cannot take in, and
    its norm's parameters become DTensors, which the layers' shared ones cannot be; no
    engine trains a mixture of experts yet (``case_refusal``)."""
    case, parallel = drawn
    if isinstance(case.model, TransformerConfig) and case.model.moe_top_k:
        case = replace(case, model=replace(case.model, moe_top_k=0))  # see case_refusal
    if parallel.mixed_precision and case.dtype != "fp32":
        case = replace(case, dtype="fp32")
    if parallel.splits_layers and isinstance(case.model, TransformerConfig) \
            and case.model.inplace_ops:
        case = replace(case, model=replace(case.model, inplace_ops=False))
    if parallel.sequence_parallel and isinstance(case.model, TransformerConfig):
        case = replace(case, model=replace(case.model, norm_position="pre",
                                           running_stats=False, outside_params=False))
    if parallel.pipeline is not None and not isinstance(case.model, TransformerConfig) \
            and parallel.pipeline.split is None:
        parallel = Parallel("ddp")  # the split by layers is the reference transformer's
    if parallel.pipeline is not None:
        case = _fit_pipeline(case, parallel.pipeline, world_size)
    return case, parallel


def _fit_pipeline(case: Case, pipelining: Pipelining, world_size: int) -> Case:
    """The case as torch's schedules can train it split by layers (``pipeline_refusal``):
    untied embeddings, no parameter or loss shared across stages, no running statistics
    (torch's shape inference feeds them uninitialised tensors), each weight used once a
    stage under a split backward, a stage's worth of layers for every stage, as many rows
    in every micro-batch."""
    model = case.model
    if not isinstance(model, TransformerConfig):
        return case
    n_stages = pipelining.n_stages(world_size)
    per_unit = case.granularity.size if isinstance(case.granularity, LayerGroups) else 1
    split = PIPELINE_SCHEDULES[pipelining.schedule].split_backward
    model = replace(model, tie_embeddings=False, outside_params=False, aux_loss=False,
                    freeze_embeddings=False, frozen_first_layer=False, running_stats=False,
                    layer_repeats=1 if split else model.layer_repeats,
                    n_layer=max(model.n_layer, (n_stages - 2) * per_unit))
    micro = pipelining.micro_batches
    rows = -(-max(case.batch.batch_size, micro) // micro) * micro  # as many in each
    return replace(case, model=model, batch=replace(case.batch, batch_size=rows))
