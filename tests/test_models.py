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


# The knobs that make segments look like other real layers: an aux output (MoE router),
# weight sharing (one segment called twice) and x0 by keyword.

SEGMENT_KNOBS = [dict(aux_loss=True), dict(layer_repeats=2), dict(x0_keyword=True),
                 dict(aux_loss=True, layer_repeats=2, x0_keyword=True)]


@pytest.mark.parametrize("bad, message", [
    (dict(layer_repeats=0), "layer_repeats=0: must be a whole number >= 1"),
    (dict(layer_repeats=1.5), "layer_repeats=1.5: must be a whole number"),
    (dict(aux_loss="yes"), "aux_loss='yes': must be true or false"),
    (dict(x0_keyword=1), "x0_keyword=1: must be true or false"),
])
def test_bad_segment_knobs_name_the_value(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        replace(CONFIG, **bad)


def test_the_segment_knobs_default_off_and_old_json_loads() -> None:
    data = CONFIG.to_dict()
    assert {data.pop(k) for k in ("aux_loss", "layer_repeats", "x0_keyword")} == {False, 1}
    assert TransformerConfig(**data) == CONFIG  # a case written before the knobs
    assert build(CONFIG, BatchConfig(), 0).model.blocks[0].expert_router is None
    on = replace(CONFIG, aux_loss=True, layer_repeats=2, x0_keyword=True)
    assert TransformerConfig(**on.to_dict()) == on and not on.has_randomness


@pytest.mark.parametrize("text", ["layer", "every:2", "group:2", "group:3", "attention", "mlp"])
def test_the_aux_loss_is_a_second_output_every_router_learns_from(text: str) -> None:
    workload = build(replace(CONFIG, aux_loss=True), BatchConfig(2, 8), 0)
    segments = workload.segments(parse_granularity(text))
    assert segments  # every granularity still builds
    workload.model.router.install(segments, None)
    outputs = workload.model(*workload.inputs)
    assert isinstance(outputs, tuple) and len(outputs) == 2
    logits, aux = outputs
    assert logits.shape == (2, 8, CONFIG.vocab_size) and aux.dim() == 0 and aux.item() > 0
    loss = workload.loss_fn(outputs, workload.targets)
    token = torch.nn.functional.cross_entropy(
        logits.view(-1, logits.size(-1)), workload.targets.view(-1), ignore_index=-100)
    assert torch.allclose(loss, token + aux)
    loss.backward()
    for block in workload.model.blocks:
        grad = block.expert_router.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_a_group_returns_its_layers_summed_aux() -> None:
    workload = build(replace(CONFIG, aux_loss=True), BatchConfig(2, 8), 0)
    groups: list[Any] = []
    segments = workload.segments(parse_granularity("group:2"))
    for segment in segments:
        segment.module.register_forward_hook(lambda m, a, out: groups.append(out))
    workload.model.router.install(segments, None)
    _, aux = workload.model(*workload.inputs)
    assert len(groups) == 2 and all(isinstance(g, tuple) and len(g) == 2 for g in groups)
    assert torch.allclose(aux, groups[0][1] + groups[1][1])


@pytest.mark.parametrize("text", ["none", "layer", "group:2"])
def test_layer_repeats_calls_one_segment_twice_per_forward(text: str) -> None:
    workload = build(replace(CONFIG, layer_repeats=2), BatchConfig(2, 8), 0)
    workload.model.router.install(workload.segments(parse_granularity(text)), None)
    inputs: list[torch.Tensor] = []
    workload.model.blocks[0].register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    loss = workload.loss_fn(workload.model(*workload.inputs), workload.targets)
    assert len(inputs) == 2 and not torch.equal(inputs[0], inputs[1])  # new input each time
    once = build(CONFIG, BatchConfig(2, 8), 0)
    assert loss.item() != once.loss_fn(once.model(*once.inputs), once.targets).item()


@pytest.mark.parametrize("text", ["layer", "group:2"])
def test_x0_reaches_every_segment_by_keyword(text: str) -> None:
    workload = build(replace(CONFIG, x0_keyword=True), BatchConfig(2, 8), 0)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    workload.model.router.install(workload.segments(parse_granularity(text)), None)
    workload.model.router.on_call = lambda name, args, kwargs: seen.append((args, kwargs))
    workload.model(*workload.inputs)
    x0 = seen[0][1]["x0"]
    assert len(seen) == len(workload.model.router._names) and x0.requires_grad
    for args, kwargs in seen:
        assert len(args) == 1 and kwargs["x0"] is x0  # x alone goes by position
        assert kwargs["key_padding_mask"].dtype == torch.bool and kwargs["causal"] is True
    assert seen[1][0][0] is not x0
    plain = build(CONFIG, BatchConfig(2, 8), 0)  # the same function, only called otherwise
    assert torch.equal(workload.model(*workload.inputs), plain.model(*plain.inputs))


def _loss_and_grads(config: TransformerConfig, text: str, checkpointed: bool
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[Any]]:
    workload = build(config, BatchConfig(2, 8), 0)
    model = workload.model
    segments = workload.segments(parse_granularity(text))
    model.router.install(segments, None)
    calls: list[Any] = []
    model.router.on_call = lambda name, args, kwargs: calls.append((name, args, kwargs))
    if checkpointed:
        model.gradient_checkpointing_enable()
        assert all(model.router.routes(s.module) for s in segments)
    outputs = model(*workload.inputs)
    loss = workload.loss_fn(outputs, workload.targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, [outputs, *calls]


@pytest.mark.parametrize("knobs", SEGMENT_KNOBS, ids=lambda k: ",".join(k))
@pytest.mark.parametrize("text", ["layer", "group:2"])
def test_torch_checkpoint_matches_full_storage_bitwise_with_each_knob(
        knobs: dict[str, Any], text: str) -> None:
    config = replace(CONFIG, **knobs)
    plain_loss, plain_grads, _ = _loss_and_grads(config, text, checkpointed=False)
    loss, grads, (outputs, *calls) = _loss_and_grads(config, text, checkpointed=True)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() == {
        n for n, p in build(config, BatchConfig(), 0).model.named_parameters()
        if p.requires_grad}
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    # The knob really shaped the segments that went through the checkpoint.
    segments = 4 // (2 if text == "group:2" else 1)
    assert len(calls) == segments * config.layer_repeats
    assert isinstance(outputs, tuple) == config.aux_loss
    assert all(("x0" in kwargs) == config.x0_keyword for _, _, kwargs in calls)
    if config.aux_loss:
        assert all(f"blocks.{i}.expert_router.weight" in grads for i in range(4))


# The knobs that give segments what real layers are full of: nested inputs, in-place ops,
# value-changing hooks, parameters from outside the segment's module.

REAL_LAYER_KNOBS = ("nested_inputs", "inplace_ops", "value_hooks", "outside_params")


def test_the_real_layer_knobs_default_off_validate_and_old_json_loads() -> None:
    data = CONFIG.to_dict()
    assert {data.pop(k) for k in REAL_LAYER_KNOBS} == {False}
    assert TransformerConfig(**data) == CONFIG  # a case written before the knobs
    for knob in REAL_LAYER_KNOBS:
        with pytest.raises(InvalidArgument, match=f"{knob}='yes': must be true or false"):
            replace(CONFIG, **{knob: "yes"})
        on = replace(CONFIG, **{knob: True})
        assert TransformerConfig(**on.to_dict()) == on and not on.has_randomness


@pytest.mark.parametrize("text", ["layer", "group:2"])
def test_nested_inputs_reach_each_segment_with_no_positional_tensor(text: str) -> None:
    workload = build(replace(CONFIG, nested_inputs=True), BatchConfig(2, 8), 0)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    workload.model.router.install(workload.segments(parse_granularity(text)), None)
    workload.model.router.on_call = lambda name, args, kwargs: seen.append((args, kwargs))
    nested = workload.model(*workload.inputs)
    assert len(seen) == len(workload.model.router._names)
    for args, kwargs in seen:
        assert len(args) == 1 and isinstance(args[0], dict)
        assert not any(isinstance(v, torch.Tensor) and v.requires_grad for v in kwargs.values())
        (x,), (x0,) = args[0]["hidden"], args[0]["embedding"]
        assert x.requires_grad and x0.requires_grad
        assert kwargs["key_padding_mask"].dtype == torch.bool
    plain = build(CONFIG, BatchConfig(2, 8), 0)  # the same function, only called otherwise
    assert torch.equal(nested, plain.model(*plain.inputs))


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_inplace_ops_change_how_not_what(attention: str) -> None:
    """Without dropout the in-place model computes what the plain one does, bitwise, and
    its forward writes in place (ops ending in ``_`` on activations)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class InPlace(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            name = func.__name__.split(".")[0]
            if name.endswith("_") and not name.startswith("_"):
                self.ops.add(name)
            return func(*args, **(kwargs or {}))

    config = replace(CONFIG, attention=attention, activation="relu")
    inplace = build(replace(config, inplace_ops=True), BatchConfig(2, 8), 0)
    plain = build(config, BatchConfig(2, 8), 0)
    with InPlace() as seen:
        out = inplace.model(*inplace.inputs)
    assert torch.equal(out, plain.model(*plain.inputs))
    assert {"add_", "relu_"} <= seen.ops
    if attention == "manual":
        assert {"mul_", "masked_fill_"} <= seen.ops
    dropped = build(replace(config, inplace_ops=True, resid_dropout=0.5), BatchConfig(2, 8), 0)
    assert dropped.model.blocks[0].mlp.resid_dropout.inplace


def test_value_hooks_change_values_and_their_parameters_learn() -> None:
    hooked = build(replace(CONFIG, value_hooks=True), BatchConfig(2, 8), 0)
    plain = build(CONFIG, BatchConfig(2, 8), 0)
    names = {n for n, _ in hooked.model.named_parameters()} - {
        n for n, _ in plain.model.named_parameters()}
    assert names == {f"blocks.{i}.{n}" for i in range(4) for n in (
        "attn.qkv.lora_a", "attn.qkv.lora_b", "mlp.fc.lora_a", "mlp.fc.lora_b", "steering")}
    # every weight the two share is the same: the hooks' parameters are made last
    shared = dict(plain.model.named_parameters())
    assert all(torch.equal(p, shared[n]) for n, p in hooked.model.named_parameters()
               if n in shared)
    block = hooked.model.blocks[0]
    assert block._forward_hooks and block.attn._forward_pre_hooks and \
        block.mlp._forward_pre_hooks and block.attn.qkv._forward_hooks
    loss = hooked.loss_fn(hooked.model(*hooked.inputs), hooked.targets)
    assert loss.item() != plain.loss_fn(plain.model(*plain.inputs), plain.targets).item()
    loss.backward()
    grads = dict(hooked.model.named_parameters())
    assert all(grads[n].grad is not None and grads[n].grad.abs().sum() > 0 for n in names)


@pytest.mark.parametrize("text, names", [
    ("layer", {"shared_proj.weight", "mlp_gates"}),
    ("group:2", {"shared_proj.weight", "mlp_gates"}),
    ("attention", {"shared_proj.weight"}), ("mlp", {"mlp_gates"})])
def test_outside_params_are_read_inside_the_segments_and_owned_by_the_model(
        text: str, names: set[str]) -> None:
    from torch.overrides import TorchFunctionMode

    workload = build(replace(CONFIG, outside_params=True), BatchConfig(2, 8), 0)
    model = workload.model
    segments = workload.segments(parse_granularity(text))
    by_id = {id(p): n for n, p in model.named_parameters()}
    read: set[str] = set()

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            read.update(by_id[id(a)] for a in args if isinstance(a, torch.nn.Parameter))
            return func(*args, **(kwargs or {}))

    def inside(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with Reads():
            return module(*args, **kwargs)

    model.router.install(segments, inside)
    owned = {n for s in segments for n, _ in s.module.named_parameters()}
    assert not owned & {"shared_proj.weight", "mlp_gates"}
    workload.loss_fn(model(*workload.inputs), workload.targets).backward()
    assert read & {"shared_proj.weight", "mlp_gates"} == names
    assert model.shared_proj.weight.grad.abs().sum() > 0
    assert model.mlp_gates.grad.abs().sum() > 0


@pytest.mark.parametrize("knob", REAL_LAYER_KNOBS)
@pytest.mark.parametrize("text", ["layer", "attention", "group:2"])
def test_torch_checkpoint_matches_full_storage_bitwise_with_each_real_layer_knob(
        knob: str, text: str) -> None:
    config = replace(CONFIG, **{knob: True})
    plain_loss, plain_grads, _ = _loss_and_grads(config, text, checkpointed=False)
    loss, grads, _ = _loss_and_grads(config, text, checkpointed=True)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() == {
        n for n, p in build(config, BatchConfig(), 0).model.named_parameters()
        if p.requires_grad}
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def test_the_real_layer_knobs_are_drawn_off_first() -> None:
    """Each knob is drawn, and a case that needs one shrinks to it alone: the minimal
    drawn case has none on, the minimal with one on has the others off."""
    from hypothesis import HealthCheck, find, settings

    from gradequiv.properties.strategies import cases, transformer_configs

    quick = settings(max_examples=200, database=None, deadline=None,
                     suppress_health_check=list(HealthCheck))
    simplest = find(cases(), lambda c: True, settings=quick)
    assert not any(getattr(simplest.model, k) for k in REAL_LAYER_KNOBS)
    for knob in REAL_LAYER_KNOBS:
        found = find(transformer_configs(), lambda m, knob=knob: getattr(m, knob),
                     settings=quick)
        assert [k for k in REAL_LAYER_KNOBS if getattr(found, k)] == [knob]
        assert found.n_layer == 1 and not found.has_randomness
