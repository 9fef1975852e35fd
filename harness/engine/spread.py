"""The fixed, deterministic spread of cases that ``gradequiv check`` runs.

It covers dropout on and off, every precision regime, every granularity, both attention
paths, both norms and placements, every activation, tied and untied embeddings, padding on
and off, every way of asking for gradients (a gradient penalty through ``create_graph``
only for implementations that claim it), eval and no_grad forwards before training, layers
that return an auxiliary loss, are applied twice, take ``x0`` by keyword, keep running
statistics in buffers or run with autocast disabled inside an autocast forward, take their
tensors nested in containers and by keyword only, run in-place ops, carry value-changing
hooks, read parameters their module does not own or return a dict with None fields, and
the ways training loops drive a segment (GPipe, reversed, 1F1B and summed micro-batch
schedules, a loss backpropagated in two parts, backward inside autocast, a frozen segment,
adapters only, which parameters train changing between steps), and sizes from one layer up
to 4 layers x 128 wide x 64 tokens (segment inputs of 16k elements) and one layer of
128k-element inputs. Cheap cases come first so a broken implementation fails fast.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from gradequiv.harness.engine.case import Case
from gradequiv.harness.errors import InvalidArgument
from gradequiv.models import (
    ELEMENT_DROPOUT_SITES,
    BatchConfig,
    BatchNormConfig,
    TransformerConfig,
    parse_granularity,
)

# Config fields by name: the ``**`` below cannot be checked field by field.
_ALL_DROPOUT: dict[str, Any] = dict.fromkeys(ELEMENT_DROPOUT_SITES, 0.1)
_SMALL = TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=16)
_LARGE = TransformerConfig(n_layer=4, n_embd=128, n_head=4, max_seq_len=64, **_ALL_DROPOUT)
#: Segment inputs of 4 x 128 x 256 = 128k elements: above the 64k where implementations
#: take other paths for big boundaries (compression, partitioning).
_WIDE = TransformerConfig(n_layer=1, n_embd=256, n_head=4, max_seq_len=128, **_ALL_DROPOUT)


def _case(name: str, model: TransformerConfig | BatchNormConfig, granularity: str,
          dtype: str = "fp32", batch: BatchConfig | None = None, seed: int = 0,
          **training: Any) -> Case:
    return Case(model=model, batch=batch or BatchConfig(2, 8), seed=seed, name=name,
                granularity=parse_granularity(granularity), dtype=dtype, **training)


def default_cases() -> list[Case]:
    """Every case of the default spread, cheapest first."""
    return [
        _case("control-none", replace(_SMALL, n_layer=1, **_ALL_DROPOUT), "none"),
        _case("1L-layer-dropout", replace(_SMALL, n_layer=1, **_ALL_DROPOUT), "layer", seed=1),
        _case("2L-layer-nodropout", _SMALL, "layer", seed=2),
        _case("2L-layer-manual-attn", replace(_SMALL, attention="manual", **_ALL_DROPOUT),
              "layer", seed=3),
        _case("2L-attention-sdpa-dropout", replace(_SMALL, attn_dropout=0.2), "attention",
              seed=4),
        _case("2L-mlp-swiglu-rmsnorm", replace(_SMALL, activation="swiglu", norm="rmsnorm",
                                               mlp_dropout=0.2), "mlp", seed=5),
        _case("3L-every2-droppath-rrelu-post", replace(
            _SMALL, n_layer=3, drop_path=0.2, activation="rrelu", norm_position="post"),
            "every:2", seed=6),
        _case("4L-group2-dropout-untied", replace(
            _SMALL, n_layer=4, tie_embeddings=False, bias=False, activation="relu",
            **_ALL_DROPOUT), "group:2", batch=BatchConfig(2, 8, padding=False), seed=7),
        _case("2L-layer-bf16-nodropout", _SMALL, "layer", "bf16-autocast", seed=8),
        _case("2L-layer-bf16-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              "bf16-autocast", seed=9),
        _case("3L-attention-bf16-manual", replace(_SMALL, n_layer=3, attention="manual",
                                                  **_ALL_DROPOUT), "attention",
              "bf16-autocast", seed=10),
        _case("2L-layer-fp16-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              "fp16-autocast", seed=13),
        _case("2L-layer-bf16-model-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              "bf16-model", seed=14),
        _case("2L-layer-autograd-grad-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              seed=15, grad_mode="autograd-grad"),
        _case("2L-layer-accumulate-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              batch=BatchConfig(4, 8), seed=16, grad_mode="accumulate"),
        _case("2L-layer-inference-first-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              seed=17, inference=True),
        _case("2L-group2-aux-shared-x0kw-dropout", replace(
            _SMALL, aux_loss=True, layer_repeats=2, x0_keyword=True, **_ALL_DROPOUT),
            "group:2", seed=18),
        _case("2L-layer-aux-shared-x0kw-dropout", replace(
            _SMALL, aux_loss=True, layer_repeats=2, x0_keyword=True, **_ALL_DROPOUT),
            "layer", seed=19),
        _case("2L-layer-running-stats-inference-first", replace(
            _SMALL, running_stats=True, **_ALL_DROPOUT), "layer", seed=24, inference=True),
        _case("2L-layer-bf16-fp32-last-layer", replace(
            _SMALL, fp32_last_layer=True, **_ALL_DROPOUT), "layer", "bf16-autocast", seed=25),
        _case("2L-layer-create-graph-manual-attn", replace(
            _SMALL, attention="manual", **_ALL_DROPOUT), "layer", seed=26,
            grad_mode="create-graph"),
        _case("2L-layer-frozen-first-layer", replace(
            _SMALL, frozen_first_layer=True, **_ALL_DROPOUT), "layer", seed=27),
        _case("2L-layer-bf16-nested-inputs-dropout", replace(
            _SMALL, nested_inputs=True, **_ALL_DROPOUT), "layer", "bf16-autocast", seed=33),
        _case("2L-layer-inplace-ops-manual-attn-relu-dropout", replace(
            _SMALL, inplace_ops=True, attention="manual", activation="relu", **_ALL_DROPOUT),
            "layer", seed=34),
        _case("2L-layer-value-hooks-dropout", replace(_SMALL, value_hooks=True, **_ALL_DROPOUT),
              "layer", seed=35),
        _case("2L-layer-outside-params-dropout", replace(
            _SMALL, outside_params=True, **_ALL_DROPOUT), "layer", seed=36),
        # Layers returning a dict with None fields beside an aux loss, as library layers do
        _case("2L-layer-dict-outputs-aux-dropout", replace(
            _SMALL, segment_outputs="dict", aux_loss=True, **_ALL_DROPOUT), "layer", seed=49),
        # A mixture of experts in each layer: top-2 routing with jitter noise, capacity and
        # the router's losses attached to the activations; top-1 under bf16 at MLP
        # granularity, where the expert load is counted inside the re-run segment
        _case("2L-layer-moe-top2-dropout", replace(_SMALL, moe_top_k=2, **_ALL_DROPOUT),
              "layer", batch=BatchConfig(4, 8), seed=50),
        _case("2L-mlp-bf16-moe-top1", replace(_SMALL, moe_top_k=1), "mlp", "bf16-autocast",
              batch=BatchConfig(4, 8), seed=51),
        # How real training loops drive a segment: several micro-batches in flight, several
        # backward passes over one forward, backward inside autocast, frozen parameters
        _case("2L-layer-gpipe-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              batch=BatchConfig(4, 8), seed=38, schedule="gpipe"),
        _case("2L-layer-gpipe-reverse-two-losses-dropout", replace(_SMALL, **_ALL_DROPOUT),
              "layer", batch=BatchConfig(4, 8), seed=39, schedule="gpipe-reverse",
              backward_passes=2),
        _case("2L-layer-1f1b-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              batch=BatchConfig(6, 8), seed=40, schedule="1f1b"),
        _case("2L-layer-summed-micro-batches-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              batch=BatchConfig(4, 8), seed=41, schedule="summed"),
        _case("2L-layer-two-losses-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer", seed=42,
              backward_passes=2),
        _case("2L-layer-bf16-fp32-last-layer-backward-autocast", replace(
            _SMALL, fp32_last_layer=True, **_ALL_DROPOUT), "layer", "bf16-autocast", seed=43,
            backward_autocast=True),
        _case("2L-layer-fp32-backward-autocast-dropout", replace(_SMALL, **_ALL_DROPOUT),
              "layer", seed=44, backward_autocast=True),
        _case("3L-layer-frozen-layer-dropout", replace(_SMALL, n_layer=3, **_ALL_DROPOUT),
              "layer", seed=45, trainable="frozen-layer"),
        _case("2L-layer-changing-trainable-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer",
              seed=46, trainable="changing"),
        _case("2L-layer-adapters-only-dropout", replace(_SMALL, value_hooks=True,
                                                        **_ALL_DROPOUT), "layer", seed=47,
              trainable="adapters"),
        _case("2L-layer-16x64-dropout", replace(_SMALL, max_seq_len=64, **_ALL_DROPOUT),
              "layer", batch=BatchConfig(16, 64), seed=48),
        _case("4Lx128x64-layer-dropout", _LARGE, "layer", batch=BatchConfig(2, 64), seed=11),
        _case("4Lx128x64-group2-bf16", _LARGE, "group:2", "bf16-autocast",
              batch=BatchConfig(2, 64), seed=12),
        _case("1Lx256x128-layer-dropout-128k", _WIDE, "layer", batch=BatchConfig(4, 128),
              seed=22),
    ]


def extra_cases() -> list[Case]:
    """Named cases outside the default spread, run with ``--case NAME``.

    They are real faults of torch's own checkpoint, kept out of the default
    spread so that it measures the implementation's core: the batchnorm model
    (torch re-runs BatchNorm in training mode and so updates its running
    statistics twice; with a training forward under no_grad first, a recompute
    that updates them only in backward misses that forward's update), frozen
    embeddings (the reentrant variant gives the
    first layer no gradients when none of its inputs requires grad) and in-place
    ops on bias-free layers (torch's selective checkpoint, saving matmul outputs,
    hands the re-run a bmm's and an mm's output changed in place since, through an
    alias that moved no version counter: pytorch/pytorch#113737, #119590).
    """
    return [
        _case("2L-layer-inplace-ops-nobias-manual-attn", replace(
            _SMALL, inplace_ops=True, bias=False, attention="manual", activation="relu",
            **_ALL_DROPOUT), "layer", seed=37),
        _case("2L-layer-frozen-embeddings", replace(_SMALL, freeze_embeddings=True,
                                                    **_ALL_DROPOUT), "layer", seed=21),
        _case("batchnorm-layer", BatchNormConfig(n_layer=2, width=16, dropout=0.1), "layer",
              batch=BatchConfig(4, 1), seed=20),
        _case("batchnorm-layer-inference-first", BatchNormConfig(n_layer=2, width=16,
                                                                 dropout=0.1), "layer",
              batch=BatchConfig(4, 1), seed=23, inference=True),
    ]


def compile_cases() -> list[Case]:
    """The spread for compiled implementations (``compile-...``).

    Few models, because each compiles for seconds per setting; every drawn
    compiled case reuses one of these models (only its seed and precision
    vary), so its graphs are compiled once per run.
    """
    return [
        _case("compile-2L-layer-nodropout", _SMALL, "layer", seed=30),
        _case("compile-2L-layer-dropout", replace(_SMALL, **_ALL_DROPOUT), "layer", seed=31),
        _case("compile-2L-layer-manual-attn-dropout",
              replace(_SMALL, attention="manual", **_ALL_DROPOUT), "layer", seed=32),
    ]


#: The most bytes a case file may hold: a case's JSON is under 2 kB; a larger file (a log,
#: a device) is no case, and is not read whole.
MAX_CASE_FILE_BYTES = 1 << 20


def load_case(text: str) -> Case:
    """A case from ``--case``: its JSON, a file holding that JSON, or a case name."""
    if text.lstrip().startswith("{"):
        return Case.from_json(text)
    path = Path(text)
    try:
        is_file = path.is_file()
    except OSError:  # a name too long to be a path
        is_file = False
    if path.suffix == ".json" or is_file:
        return Case.from_json(_case_file_text(text, path))
    return find_case(text)


def _case_file_text(text: str, path: Path) -> str:
    """A case file's text: a regular file (a FIFO would wait for a writer forever) of at
    most :data:`MAX_CASE_FILE_BYTES`."""
    try:
        if path.exists() and not path.is_file():
            raise InvalidArgument(f"--case={text!r} is not a file; name a case's .json file "
                                  f"(cases/minimal-N.json of a report folder)")
        with path.open("rb") as handle:
            data = handle.read(MAX_CASE_FILE_BYTES + 1)
    except OSError as exc:
        raise InvalidArgument(f"--case={text!r} could not be read: {exc}") from exc
    if len(data) > MAX_CASE_FILE_BYTES:
        raise InvalidArgument(f"--case={text!r} holds more than {MAX_CASE_FILE_BYTES} bytes, "
                              f"far more than a case's JSON; name a case file "
                              f"(cases/minimal-N.json of a report folder)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"--case={text!r} is not UTF-8 text ({exc}); name a case's "
                              f".json file") from exc


def find_case(name: str) -> Case:
    """A named case from any of the lists; a clear error lists the names."""
    known = default_cases() + extra_cases() + compile_cases()
    for case in known:
        if case.name == name:
            return case
    names = ", ".join(c.name for c in known)
    raise InvalidArgument(
        f"--case={name!r} is neither a case name nor a JSON object; known names: {names}"
    )
