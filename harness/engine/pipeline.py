"""A case trained by torch's own pipeline schedules: the model split into stages by layers,
the stages placed on ranks, one optimizer step run by ``schedule.step``.

The reference transformer is split as torchtitan's ``pipeline_llm`` splits a decoder: its
units in call order are the embeddings, the layers the forward calls (the groups, under a
group granularity: a group is one recompute segment and never spans two stages), then the
final norm with the head; ``n_stages`` contiguous runs of them, as even as they go, earliest
stages the larger. Each stage holds the model's own submodules, so the recompute the path
installed on its segments runs inside the stage, and every stage calls its layers the way
the model's forward calls them. A boundary carries the residual stream and the embedding
output ``(x, x0)`` (every layer mixes ``x0`` back in); the padding mask goes to every stage
by keyword, as the schedule hands each stage the keyword inputs of its rank's ``step``.

Stages sit on ranks as the schedule needs them: one per rank (GPipe, 1F1B), several per
rank in a loop (stage ``s`` on rank ``s % world_size``: Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble), or two per rank in a V (ZBVZeroBubble, DualPipeV: rank 0 holds the
first and the last stage). Everything past the split is torch's: metadata inference on the
first step, send and receive, the loss on the last stage, the zero-bubble schedules'
backward split into an input pass and a weight pass, and gradients divided by the number of
micro-batches (the micro-batches' mean, as the runner's ``loss / n``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from gradequiv.harness.engine.case import Case
from gradequiv.harness.engine.path import PreparedPath
from gradequiv.harness.engine.schedules import (
    ONE_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    Pipelining,
)
from gradequiv.harness.errors import InvalidArgument
from gradequiv.models import TransformerConfig
from gradequiv.models.external import ExternalConfig
from gradequiv.models.granularity import LayerGroups
from gradequiv.models.segments import unwrapped_name, user_view
from gradequiv.models.transformer import Transformer, _run_layer

__all__ = ["PIPELINE_SCHEDULES", "Pipelining", "RankStep", "StagedPath", "UserStage",
           "load_split", "pipeline_refusal", "split_stages", "user_split_refusal"]


def pipeline_refusal(case: Case, pipelining: Pipelining | None = None,
                     world_size: int = 2) -> str | None:
    """Why ``case`` cannot be trained through ``pipelining`` on ``world_size`` ranks, in a
    sentence that names what to change; None where it can. Without ``pipelining``, only what
    the case itself rules out, whatever the schedule. A user's model is judged here as far
    as its case says; what its batch and its split function rule out needs the model
    built (``user_split_refusal``)."""
    model = case.model
    if isinstance(model, ExternalConfig):
        return _user_refusal(case, pipelining, world_size)
    if not isinstance(model, TransformerConfig):
        return (f"model kind {case.model_kind!r}: the pipeline split is the reference "
                f"transformer's (embeddings, layers, norm and head); a user's model "
                f"(--model) needs a split function of its own (--split module:function)")
    why = _model_refusal(model) or _training_refusal(case)
    if why or pipelining is None:
        return why
    if pipelining.split is not None:
        return (f"--split={pipelining.split!r} with the reference transformer: it is split "
                f"by layers; --split cuts a --model's stages, so leave it out")
    units = _unit_count(case)
    n = pipelining.n_stages(world_size)
    if n > units:
        return (f"{n} stages ({pipelining.per_rank} per rank on {world_size} ranks) out of "
                f"{units} units (embeddings, {units - 2} layer(s) or group(s) under "
                f"granularity {case.granularity}, norm and head): a stage needs one at "
                f"least; use fewer stages per rank, more layers or smaller groups")
    why = _micro_batch_refusal(pipelining, world_size)
    if why:
        return why
    kind = PIPELINE_SCHEDULES[pipelining.schedule]
    if kind.split_backward and model.layer_repeats > 1:
        return (f"layer_repeats={model.layer_repeats} under {kind.torch_name}: its "
                f"weight pass cannot take the gradient of a weight used twice in one stage "
                f"(full storage raises 'Trying to backward through the graph a second time' "
                f"in torch 2.13); use layer_repeats=1 or a schedule without a weight pass")
    rows, micro = case.batch.batch_size, pipelining.micro_batches
    if rows % micro:
        return (f"batch_size={rows} with micro_batches={micro}: the schedule splits the "
                f"inputs and the targets into micro-batches each its own way where the rows "
                f"do not divide evenly (the loss then meets logits and targets of other "
                f"sizes); use a batch_size that is a multiple of {micro}")
    return None


def _micro_batch_refusal(pipelining: Pipelining, world_size: int) -> str | None:
    """The fewest micro-batches the schedule takes (Schedule1F1B refuses fewer when made)."""
    kind = PIPELINE_SCHEDULES[pipelining.schedule]
    least = kind.min_micro_batches_per_stage * pipelining.n_stages(world_size)
    if pipelining.micro_batches < least:
        return (f"micro_batches={pipelining.micro_batches} under {kind.torch_name}: it takes "
                f"one per stage at least; use micro_batches >= {least}")
    return None


def _user_refusal(case: Case, pipelining: Pipelining | None, world_size: int) -> str | None:
    """What rules out a user's model before it is built: the training loop the schedule
    replaces, a split function not named, too few micro-batches for the schedule."""
    why = _training_refusal(case)
    if why or pipelining is None:
        return why
    if pipelining.split is None:
        return _no_split(case)
    return _micro_batch_refusal(pipelining, world_size)


def _no_split(case: Case) -> str:
    factory = cast("ExternalConfig", case.model).factory
    return (f"--model {factory} under --wrapper pp without --split: the split by layers is "
            f"the reference transformer's, and only your code knows where your model's "
            f"stages part; name a function with --split module:function, called as "
            f"function(model, n_stages) and returning n_stages nn.Modules, in order, that "
            f"hold the model's own submodules")


def user_split_refusal(case: Case, pipelining: Pipelining, world_size: int) -> str | None:
    """What a user's model, built once on the CPU, rules out under ``pipelining``: a batch
    whose rows do not divide into the micro-batches, a split function that does not give
    the stages (None: the reference transformer's, or nothing to refuse). Called before
    any rank starts, so a mistake is a usage error, not a case that fails on the ranks."""
    if not isinstance(case.model, ExternalConfig) or pipelining.split is None:
        return None
    from gradequiv.harness.engine.path import build_path

    path = build_path(case, torch.device("cpu"))
    why = _rows_refusal(path, pipelining)
    if why:
        return why
    try:
        split_stages(path, pipelining.n_stages(world_size), pipelining.split)
    except InvalidArgument as exc:
        return str(exc)
    return None


def _rows_refusal(path: PreparedPath, pipelining: Pipelining) -> str | None:
    """A user's batch that torch's schedule cannot split: it cuts every input and the
    targets into ``micro_batches`` parts along their first dimension."""
    micro = pipelining.micro_batches
    factory = cast("ExternalConfig", path.case.model).factory
    tensors = [t for t in (*path.inputs, path.targets) if t is not None]
    rows = sorted({t.shape[0] if t.dim() else 0 for t in tensors})
    if len(rows) > 1:
        return (f"--model {factory}: its inputs and targets have {rows} rows: torch's "
                f"schedule cuts each into micro-batches by its first dimension, so the loss "
                f"would meet outputs and targets of other sizes; give every input and the "
                f"targets the batch's rows first")
    if not rows or rows[0] == 0 or rows[0] % micro:
        have = rows[0] if rows else 0
        return (f"--model {factory}: its batch has {have} rows, with micro_batches={micro}: "
                f"torch's schedule splits the inputs and the targets into micro-batches of "
                f"as many rows each, which {have} rows do not give; use --micro-batches that "
                f"divides {have}, or a batch of a multiple of {micro} rows")
    return None


def load_split(spec: str) -> Callable[[nn.Module, int], Any]:
    """The user's ``split(model, n_stages) -> [stage, ...]`` named by ``module:function``."""
    from gradequiv.harness.implementations.resolve import user_function

    return user_function("--split", spec, "function (model, n_stages) -> list of nn.Modules")


def _model_refusal(model: TransformerConfig) -> str | None:
    """The reference transformer's knobs that no split by layers can carry."""
    if model.tie_embeddings:
        return ("tie_embeddings=true: the token embedding's weight is also the head's, on the "
                "first and the last stage; torch's schedules neither sum its two gradients "
                "across ranks nor scale it once where both stages share a rank; use "
                "tie_embeddings=false")
    if model.outside_params:
        return ("outside_params=true: the projection and the gates the model owns are read "
                "by the layers of every stage, which would each hold a copy whose gradients "
                "no schedule sums; use outside_params=false")
    if model.aux_loss:
        return ("aux_loss=true: the layers' summed aux loss would have to cross every stage "
                "boundary beside the hidden state to reach the loss on the last stage; use "
                "aux_loss=false")
    if model.running_stats:
        return ("running_stats=true: torch's pipeline stages infer their shapes on the first "
                "step by a training-mode forward of every stage past the first on tensors "
                "made from metadata, uninitialised, whose statistics then reach the running "
                "buffers (NaN on both paths in torch 2.13); use running_stats=false")
    if model.freeze_embeddings or model.frozen_first_layer:
        knob = "freeze_embeddings" if model.freeze_embeddings else "frozen_first_layer"
        return (f"{knob}=true: a stage whose outputs need no gradient sends none back, which "
                f"torch's stage refuses at its first backward; use {knob}=false")
    return None


def _training_refusal(case: Case) -> str | None:
    """The training-loop dimensions a schedule replaces: it has its own micro-batches and
    runs one backward of each itself."""
    if case.schedule != "one":
        return (f"schedule={case.schedule!r}: the pipeline's schedule drives the "
                f"micro-batches; use schedule='one' and name the pipeline's")
    if case.grad_mode != "backward":
        return (f"grad_mode={case.grad_mode!r}: torch's schedule runs each micro-batch's "
                f"backward itself; use grad_mode='backward'")
    if case.backward_passes != 1 or case.backward_autocast:
        return ("backward_passes > 1 or backward_autocast: torch's schedule runs each "
                "micro-batch's backward itself, once, outside autocast; use "
                "backward_passes=1 and backward_autocast=false")
    if case.trainable != "all":
        return (f"trainable={case.trainable!r}: a stage whose outputs need no gradient sends "
                f"none back, which torch's stage refuses; use trainable='all'")
    return None


def _unit_count(case: Case) -> int:
    """Embeddings, the layers (or groups) the forward calls, norm and head."""
    model = cast("TransformerConfig", case.model)
    granularity = case.granularity
    layers = model.n_layer
    if isinstance(granularity, LayerGroups):
        layers = -(-layers // granularity.size)
    return layers + 2


class _Embeddings(nn.Module):
    """The model's token and position embeddings and their dropout (the first unit)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.wte, self.wpe, self.embd_dropout = model.wte, model.wpe, model.embd_dropout

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        out: Tensor = self.embd_dropout(self.wte(tokens) + self.wpe(pos))  # (B, T, C)
        return out


class _Head(nn.Module):
    """The model's final norm and head (the last unit)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.norm_f, self.lm_head = model.norm_f, model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.norm_f(x))  # (B, T, vocab)
        return out


class _Placed(nn.Module):
    """A stage that knows its place in the pipeline: ``index`` of ``count``."""

    index: int
    count: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


class Stage(_Placed):
    """One pipeline stage of the reference transformer: its own run of the model's units,
    called under the case's autocast. The first stage takes the tokens, the others the
    previous stage's ``(x, x0)``; the last returns the logits, the others ``(x, x0)``."""

    _model: Transformer

    def __init__(self, model: Transformer, case: Case, units: list[nn.Module],
                 index: int, count: int) -> None:
        super().__init__()
        self.index, self.count = index, count
        self.embeddings = units[0] if isinstance(units[0], _Embeddings) else None
        self.head = units[-1] if isinstance(units[-1], _Head) else None
        self.layers = nn.ModuleList(u for u in units if not isinstance(u, (_Embeddings, _Head)))
        self._case = case
        # The model's router and call settings, held outside the module tree: a stage's
        # parameters are its own units' only.
        object.__setattr__(self, "_model", model)

    def forward(self, *args: Tensor, key_padding_mask: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        model = self._model
        config = model.config
        with self._case.autocast(args[0].device):
            if self.is_first:
                x0 = cast("_Embeddings", self.embeddings)(args[0])
                x = x0
            else:
                x, x0 = args
            for layer in self.layers:
                for _ in range(config.layer_repeats):
                    x, _ = _run_layer(model.router, layer, x, x0, key_padding_mask,
                                      x0_keyword=config.x0_keyword, causal=True,
                                      residual_scale=model.residual_scale,
                                      nested=config.nested_inputs,
                                      outputs=config.segment_outputs)
            if self.is_last:
                logits: Tensor = cast("_Head", self.head)(x)
                return logits
            # x0 leaves as a tensor of its own: a zero-bubble input pass detaches each stage
            # output in place, and x0 passed on as it came is this stage's input, which its
            # checkpointed layers would then re-run, in the weight pass, as needing no grad
            return x, x0.clone()


def split_stages(path: PreparedPath, n_stages: int, split: str | None = None
                 ) -> list[Stage] | list[UserStage]:
    """The path's model as ``n_stages`` stages, in order (every stage, on every rank: each
    keeps the ones the schedule places on it): the reference transformer by layers, a
    user's model by its ``split`` function. Raises InvalidArgument where the case is
    refused (``pipeline_refusal``) or the split function gives no such stages."""
    why = pipeline_refusal(path.case)
    if why:
        raise InvalidArgument(why)
    if isinstance(path.case.model, ExternalConfig):
        if split is None:
            raise InvalidArgument(_no_split(path.case))
        return _split_user_model(path, n_stages, split)
    model = cast("Transformer", path.model)
    grouped = isinstance(path.case.granularity, LayerGroups)
    layers = [s.module for s in path.segments] if grouped else list(model.blocks)
    units: list[nn.Module] = [_Embeddings(model), *layers, _Head(model)]
    if not 1 <= n_stages <= len(units):
        raise InvalidArgument(f"n_stages={n_stages}: the model has {len(units)} units "
                              f"(embeddings, {len(layers)} layer(s) or group(s), head); use "
                              f"1 to {len(units)} stages")
    base, extra = divmod(len(units), n_stages)
    stages, start = [], 0
    for s in range(n_stages):
        stop = start + base + (s < extra)
        stages.append(Stage(model, path.case, units[start:stop], s, n_stages))
        start = stop
    return stages


class UserStage(_Placed):
    """One stage of a user's model: the module their split function returned, called under
    the case's autocast. The first takes the model's inputs (its keyword inputs by their
    names, as ``ExternalModel.forward`` hands them), the others the previous stage's output
    as it came; the last returns what the user's loss takes. An input the module hands on
    unchanged leaves as a copy, as the reference stage's ``x0`` does (``_own_outputs``)."""

    def __init__(self, inner: nn.Module, case: Case, device: torch.device, index: int,
                 count: int, input_keys: tuple[str, ...]) -> None:
        super().__init__()
        self.inner = inner
        self.index, self.count = index, count
        self._case, self._device, self._input_keys = case, device, input_keys

    def forward(self, *args: Any) -> Any:
        with self._case.autocast(self._device):
            if self.is_first and self._input_keys:
                k = len(args) - len(self._input_keys)
                out = self.inner(*args[:k], **dict(zip(self._input_keys, args[k:])))
            else:
                out = self.inner(*args)
        return _own_outputs(out, args)


def _own_outputs(out: Any, args: tuple[Any, ...]) -> Any:
    """``out`` with each tensor that is one of ``args`` (handed on unchanged) cloned.
    torch's zero-bubble input pass detaches every stage output in place: an output that is
    the stage's input would leave that input needing no gradient, and a checkpointed layer
    of the stage that reads it then re-runs, in the weight pass, on other terms than its
    forward (torch's checkpoint raises "A different number of tensors was saved")."""
    inputs = {id(a) for a in args if isinstance(a, Tensor)}

    def own(t: Any) -> Any:
        return t.clone() if isinstance(t, Tensor) and id(t) in inputs else t

    if isinstance(out, (tuple, list)):
        return type(out)(own(t) for t in out)
    return own(out)


def _split_user_model(path: PreparedPath, n_stages: int, split: str) -> list[UserStage]:
    """The user's model cut by their function into ``n_stages`` stages, checked: as many as
    asked, each an nn.Module, holding the model's own parameters (a copy would train
    weights nothing compares), none held by two stages (no schedule sums its gradients)."""
    model = user_view(path.model)
    made = load_split(split)(model, n_stages)
    said = f"--split={split!r} returned"
    if not isinstance(made, (list, tuple)) or len(made) != n_stages:
        got = (f"{len(made)} stage(s)" if isinstance(made, (list, tuple))
               else f"a {type(made).__name__}")
        raise InvalidArgument(f"{said} {got} for n_stages={n_stages}: the schedule places "
                              f"exactly n_stages stages on the ranks; return a list of "
                              f"n_stages nn.Modules, in order")
    for k, stage in enumerate(made):
        if not isinstance(stage, nn.Module):
            raise InvalidArgument(f"{said} a {type(stage).__name__} as stage {k}: torch's "
                                  f"PipelineStage runs an nn.Module; return the model's own "
                                  f"submodules in nn.Modules (an nn.Sequential, or a module "
                                  f"of your own whose forward calls them)")
    owned = {id(p): n for n, p in model.named_parameters()}
    holder: dict[int, int] = {}
    for k, stage in enumerate(made):
        for p in stage.parameters():
            if id(p) not in owned:
                raise InvalidArgument(f"{said} stage {k} with a parameter of shape "
                                      f"{tuple(p.shape)} that is not the model's: a stage "
                                      f"must hold the model's own submodules, not copies "
                                      f"(the recompute is installed on the model's)")
            if holder.setdefault(id(p), k) != k:
                raise InvalidArgument(f"{said} {owned[id(p)]} in stages {holder[id(p)]} and "
                                      f"{k}: no schedule sums a gradient across stages; give "
                                      f"each parameter to one stage")
    keys = tuple(getattr(path.model, "input_keys", ()))
    return [UserStage(stage, path.case, path.device, k, n_stages, keys)
            for k, stage in enumerate(made)]


@dataclass
class RankStep:
    """What one optimizer step through the schedule left on this rank, before the optimizer
    moved the weights."""

    stages: tuple[int, ...]  # the stages this rank holds
    losses: list[Tensor]  # each micro-batch's loss (unscaled), where the last stage is here
    # each parameter of this rank's stages, by its name in the whole model (None: no gradient)
    grads: dict[str, Tensor | None] = field(default_factory=dict)
    output: Tensor | None = None  # the micro-batches' logits joined, where the last stage is


class StagedPath:
    """A prepared path trained through torch's pipeline schedule on this rank: its stages,
    the schedule over them and an optimizer over their parameters, built once; ``step``
    trains one optimizer step. Every rank of ``group`` builds one, with the same case and
    ``pipelining``, and calls ``step`` at the same points. ``rank`` and ``world_size`` are
    the pipeline's (``group``'s). ``data_parallel``: a device mesh over the ranks that hold
    the same stages (PP x DP): each stage is FSDP2-sharded over it (``fully_shard``)
    before torch's stage takes it, as torchtitan composes the two; each of those ranks
    trains its own rows."""

    def __init__(self, path: PreparedPath, pipelining: Pipelining, rank: int,
                 world_size: int, group: Any = None, data_parallel: Any = None) -> None:
        from torch.distributed import pipelining as pp

        from gradequiv.harness.engine.runner import LEARNING_RATE, MOMENTUM

        why = pipeline_refusal(path.case, pipelining, world_size)
        if why:
            raise InvalidArgument(why)
        user = isinstance(path.case.model, ExternalConfig)
        why = _rows_refusal(path, pipelining) if user else None
        if why:
            raise InvalidArgument(why)
        self.path, self.pipelining, self.user = path, pipelining, user
        every: list[Any] = list(split_stages(path, pipelining.n_stages(world_size),
                                             pipelining.split))
        placed = pipelining.stage_ranks(world_size)
        self.stages = [s for s in every if placed[s.index] == rank]
        if data_parallel is not None:
            from torch.distributed.fsdp import fully_shard

            for stage in self.stages:
                fully_shard(stage, mesh=data_parallel)
        self.torch_stages = torch_stages = [
            pp.PipelineStage(s, s.index, s.count, path.device, group=group) for s in self.stages]
        kind = PIPELINE_SCHEDULES[pipelining.schedule]
        schedule_class = getattr(pp, kind.torch_name)
        held = torch_stages[0] if pipelining.schedule in ONE_STAGE_SCHEDULES else torch_stages
        self.schedule = schedule_class(held, pipelining.micro_batches,
                                       loss_fn=self._loss_fn())
        # the names the user's model gives (its own, not ExternalModel's ``inner.`` ones)
        named = {id(p): unwrapped_name(name)
                 for name, p in user_view(path.model).named_parameters()}
        self.local_parameters = [(named[id(p)], p) for s in self.stages for p in s.parameters()]
        self.optimizer = torch.optim.SGD([p for _, p in self.local_parameters], lr=LEARNING_RATE,
                                         momentum=MOMENTUM)

    def _loss_fn(self) -> Callable[[Any, Tensor], Tensor]:
        """The workload's loss under the case's autocast, as ``PreparedPath.forward`` takes it."""
        path = self.path

        def loss_fn(outputs: Any, targets: Tensor) -> Tensor:
            with path.case.autocast(path.device):
                return path.workload.loss_fn(outputs, targets)

        return loss_fn

    @property
    def holds_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def holds_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def step(self, *, optimize: bool = True) -> RankStep:
        """One optimizer step: ``schedule.step`` over the whole batch (the tokens where the
        first stage is, the targets and the losses where the last is, the padding mask on
        every rank), the gradients kept, then the optimizer's step. ``optimize=False``:
        the caller zeroes the gradients and steps an optimizer of its own."""
        if not optimize:
            return self._scheduled()
        self.optimizer.zero_grad(set_to_none=True)
        done = self._scheduled()
        self.optimizer.step()
        return done

    def _scheduled(self) -> RankStep:
        """``schedule.step`` over the whole batch, what it left kept."""
        if self.user:  # every input to the first stage, whose forward names the keywords
            args: tuple[Any, ...] = tuple(self.path.inputs) if self.holds_first else ()
            kwargs: dict[str, Any] = {}
        else:
            tokens, mask = self.path.inputs
            args = (tokens,) if self.holds_first else ()
            kwargs = {} if mask is None else {"key_padding_mask": mask}
        losses: list[Tensor] | None = [] if self.holds_last else None
        target = self.path.targets if self.holds_last else None
        output = self.schedule.step(*args, target=target, losses=losses, **kwargs)
        grads = {name: None if p.grad is None else p.grad.detach().clone()
                 for name, p in self.local_parameters}
        return RankStep(tuple(s.index for s in self.stages),
                        [t.detach() for t in losses or []], grads,
                        output.detach() if isinstance(output, Tensor) else None)
