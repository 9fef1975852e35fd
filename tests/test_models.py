"""The reference models: segments per granularity, the router, the fixed batch, configs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from gradequiv.models import (
    BatchConfig,
    BatchNormConfig,
    InvalidArgument,
    LayerGroups,
    TransformerConfig,
    build,
    make_batch,
    parse_granularity,
)

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
