"""The reference models: segments per granularity, the router, the fixed batch, configs."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields, replace
from typing import Any

import pytest
import torch

from gradequiv.harness.engine.case import Case
from gradequiv.harness.reports.bundle import report_schema
from gradequiv.harness.reports.findings import random_sites
from gradequiv.models import (
    DRAWN_MODELS,
    DROPOUT_SITES,
    ELEMENT_DROPOUT_SITES,
    MODEL_KINDS,
    AttentionOnly,
    BatchConfig,
    BatchNormConfig,
    ExternalConfig,
    InvalidArgument,
    LayerGroups,
    TransformerConfig,
    build,
    layer_runs,
    make_batch,
    parse_granularity,
)
from gradequiv.models.granularity import SINGLE_LAYERS

CONFIG = TransformerConfig(n_layer=4, n_embd=16, n_head=2, max_seq_len=16)


@pytest.mark.parametrize("text, names", [
    ("none", []),
    ("layer", ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]),
    ("every:2", ["blocks.0", "blocks.2"]),
    ("every:3", ["blocks.0", "blocks.3"]),
    ("group:2", ["blocks.0-1", "blocks.2-3"]),
    ("group:3", ["blocks.0-2", "blocks.3-3"]),
    ("attention", [f"blocks.{i}.attn" for i in range(4)]),
    ("mlp", [f"blocks.{i}.mlp" for i in range(4)]),
])
def test_segments_per_granularity(text: str, names: list[str]) -> None:
    model = build(CONFIG, BatchConfig(), 0).model
    assert [s.name for s in model.segments(parse_granularity(text))] == names


def test_granularity_round_trips_through_text() -> None:
    for text in ("none", "layer", "every:2", "group:3", "attention", "mlp"):
        assert str(parse_granularity(text)) == text


@pytest.mark.parametrize("text", ["layers", "every", "group:0", "every:-1", "mlp:2"])
def test_bad_granularity_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgument, match="granularity"):
        parse_granularity(text)


def test_groups_keep_parameter_names_and_the_state_dict() -> None:
    model = build(CONFIG, BatchConfig(), 0).model
    before = list(model.state_dict())
    model.segments(LayerGroups(2))
    assert list(model.state_dict()) == before


def test_segments_receive_what_real_layers_receive() -> None:
    workload = build(CONFIG, BatchConfig(2, 8), 0)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    segments = workload.segments(parse_granularity("layer"))
    workload.model.router.install(segments, None)
    workload.model.router.on_call = lambda name, args, kwargs: seen.append((args, kwargs))
    workload.model(*workload.inputs)
    args, kwargs = seen[1]
    x, x0, mask = args
    assert x.requires_grad and x0.requires_grad and x is not x0  # two tensors needing grad
    assert mask.dtype == torch.bool and not mask.requires_grad  # a tensor that does not
    assert kwargs == {"causal": True, "residual_scale": pytest.approx(0.5 ** 1.5)}


def test_the_router_calls_an_installed_segment_through_the_implementation() -> None:
    workload = build(CONFIG, BatchConfig(2, 8), 0)
    calls: list[str] = []

    def impl(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(module).__name__)
        return module(*args, **kwargs)

    workload.model.router.install(workload.segments(parse_granularity("mlp")), impl)
    workload.model(*workload.inputs)
    assert calls == ["MLP"] * 4


def test_the_fixed_batch_is_a_function_of_the_seed() -> None:
    a = make_batch(CONFIG, BatchConfig(3, 12), 7)
    b = make_batch(CONFIG, BatchConfig(3, 12), 7)
    c = make_batch(CONFIG, BatchConfig(3, 12), 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    assert not torch.equal(a[0], c[0])


def test_padding_masks_tokens_and_targets() -> None:
    tokens, mask, targets = make_batch(CONFIG, BatchConfig(4, 12), 1)
    assert mask is not None and mask[0].all() and mask[:, 0].all()
    assert (targets[~mask] == -100).all() and (tokens[~mask] == 0).all()
    assert (targets[mask] >= 0).all()
    _, none, _ = make_batch(CONFIG, BatchConfig(4, 12, padding=False), 1)
    assert none is None


def test_the_same_seed_builds_the_same_weights() -> None:
    a = build(CONFIG, BatchConfig(), 3).model.state_dict()
    b = build(CONFIG, BatchConfig(), 3).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


KNOBS = [
    dict(attention="manual", attn_dropout=0.2), dict(attention="sdpa", attn_dropout=0.2),
    dict(norm="rmsnorm", norm_position="post"), dict(activation="swiglu"),
    dict(activation="rrelu"), dict(activation="relu", bias=False), dict(drop_path=0.3),
    dict(tie_embeddings=False), dict(embd_dropout=0.5, resid_dropout=0.5, mlp_dropout=0.5),
    dict(freeze_embeddings=True),
]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(k))
def test_every_knob_trains_and_its_randomness_shows(knobs: dict[str, Any]) -> None:
    config = replace(CONFIG, **knobs)
    workload = build(config, BatchConfig(2, 8), 0)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        loss = workload.loss_fn(workload.model(*workload.inputs), workload.targets)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert (losses[0] != losses[1]) == config.has_randomness


def test_eval_mode_turns_every_random_op_off() -> None:
    config = replace(CONFIG, **KNOBS[-2], drop_path=0.3, activation="rrelu", attn_dropout=0.3)
    workload = build(config, BatchConfig(2, 8), 0)
    workload.model.eval()
    outs = [workload.model(*workload.inputs) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("bad, message", [
    (dict(n_layer=0), "n_layer=0"), (dict(n_head=3), "not divisible by n_head=3"),
    (dict(attn_dropout=1.0), "attn_dropout=1.0"), (dict(norm="batchnorm"), "norm='batchnorm'"),
    (dict(activation="tanh"), "activation='tanh'"), (dict(attention="flash"), "'flash'"),
])
def test_bad_transformer_configs_name_the_value(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        replace(CONFIG, **bad)


def test_a_batch_longer_than_the_model_allows_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="seq_len=32 exceeds max_seq_len=16"):
        build(CONFIG, BatchConfig(2, 32), 0)


def test_the_batchnorm_model_needs_two_samples_and_has_running_buffers() -> None:
    with pytest.raises(InvalidArgument, match="batch_size=1"):
        build(BatchNormConfig(), BatchConfig(1, 1), 0)
    workload = build(BatchNormConfig(), BatchConfig(4, 1), 0)
    assert {n for n, _ in workload.model.named_buffers()} >= {"blocks.0.bn.running_mean"}
    assert workload.inputs[0] is not None and workload.inputs[0].requires_grad
    with pytest.raises(InvalidArgument, match="does not apply to the batchnorm model"):
        workload.segments(parse_granularity("attention"))


@pytest.mark.parametrize("text, runs", [
    ("none", []),
    ("layer", [[0], [1], [2], [3], [4]]),
    ("every:2", [[0], [2], [4]]),
    ("group:2", [[0, 1], [2, 3], [4]]),
    ("attention", [[0], [1], [2], [3], [4]]),
])
def test_one_rule_selects_the_layers_for_every_model(text: str, runs: list[list[int]]) -> None:
    granularity = parse_granularity(text)
    assert [list(r) for r in layer_runs(granularity, 5)] == runs
    transformer = build(replace(CONFIG, n_layer=5), BatchConfig(), 0).model
    blocks = list(transformer.blocks)
    segments = transformer.segments(granularity)
    if isinstance(granularity, AttentionOnly):
        assert [s.module for s in segments] == [blocks[run[0]].attn for run in runs]
    else:  # the layers each segment runs
        assert [list(s.counted) for s in segments] == [[blocks[i] for i in run] for run in runs]
    if isinstance(granularity, SINGLE_LAYERS):
        batchnorm = build(BatchNormConfig(n_layer=5), BatchConfig(4, 1), 0).model
        assert [s.name for s in batchnorm.segments(granularity)] == [
            f"blocks.{run[0]}" for run in runs]


@pytest.mark.parametrize("text", ["group:1", "group:2", "attention", "mlp"])
def test_the_batchnorm_model_refuses_what_is_not_single_layers(text: str) -> None:
    model = build(BatchNormConfig(n_layer=3), BatchConfig(4, 1), 0).model
    with pytest.raises(InvalidArgument, match="does not apply to the batchnorm model; use none"):
        model.segments(parse_granularity(text))


def test_the_random_sites_are_every_probability_of_the_config() -> None:
    """A new dropout field is a random site: the table, and every reader of it, must know it."""
    floats = [f.name for f in fields(TransformerConfig) if f.type == "float"]
    assert list(DROPOUT_SITES) == floats
    assert set(ELEMENT_DROPOUT_SITES) == set(floats) - {"drop_path"}
    for site in DROPOUT_SITES:
        config = replace(CONFIG, **{site: 0.25})
        assert config.has_randomness
        assert f"{site.removesuffix('_dropout')} 0.25" in Case(model=config).describe()
        assert random_sites(Case(model=config).to_dict()) == [DROPOUT_SITES[site]]
        with pytest.raises(InvalidArgument, match=f"{site}=1.0"):
            replace(CONFIG, **{site: 1.0})
    assert not CONFIG.has_randomness and "no random ops" in Case(model=CONFIG).describe()


def test_the_model_kinds_are_named_once() -> None:
    """The JSON schema, the case's configs and the drawn models all read MODEL_KINDS."""
    assert report_schema()["$defs"]["case"]["properties"]["model_kind"]["enum"] == list(
        MODEL_KINDS)
    kinds = {Case(model=m).model_kind
             for m in (CONFIG, BatchNormConfig(), ExternalConfig("user_models:residual_stack"))}
    assert kinds == set(MODEL_KINDS) and set(DRAWN_MODELS) < set(MODEL_KINDS)
    assert Case.from_dict({"model_kind": "batchnorm"}).model == BatchNormConfig()
    with pytest.raises(InvalidArgument, match="is not one of transformer, batchnorm, external"):
        Case.from_dict({"model_kind": "resnet"})


def test_the_package_exports_what_it_names_and_the_names_need_no_torch() -> None:
    import gradequiv.models as models

    assert sorted(models.__all__) == sorted(models._WHERE)
    assert all(getattr(models, name) is not None for name in models.__all__)
    code = ("import sys, gradequiv.models, gradequiv.models.kinds, gradequiv.harness.options; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "False"
