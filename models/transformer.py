"""A small decoder-only transformer whose layers go through a recompute router.

Read top to bottom: norms, attention, feed-forward, the block, the config, the
model. Every random op that can break recompute sits in its own named module
(embedding, attention-probability, residual and MLP dropout, stochastic depth,
RReLU noise), and the fused attention path draws its dropout inside SDPA.

Segments are called the way real layers are: two tensors that require grad
(the residual stream ``x`` and the embedding output ``x0``, which every layer
mixes back in), a padding mask that does not, and keyword arguments
(``causal``, ``residual_scale``) whose loss would change the result. Six
knobs make segments look like other real layers, each off by default:

* ``x0_keyword``: ``x0`` (and so the mask after it) goes by keyword,
  ``layer(x, x0=x0, key_padding_mask=mask, ...)``, as a tensor needing grad
  in ``kwargs``;
* ``aux_loss``: each layer also computes an MoE-router z-loss from its own
  parameters and its input and returns ``(x, aux)``, a group ``(x, its summed
  aux)``; the model returns ``(logits, total aux)`` and the loss adds the aux;
* ``layer_repeats``: weight sharing, each segment (a layer, or a group under
  group granularity) called that many times in a row in one forward, each
  time on a new input;
* ``running_stats``: each MLP keeps statistics of its input in buffers, as MoE
  routers keep their load statistics and BatchNorm ``num_batches_tracked``: two
  int64 counters and a running mean, moved by every training-mode forward and by
  no re-run of it inside backward (a recompute), so that buffers must come out
  exactly as with full storage;
* ``fp32_last_layer``: the last layer runs under ``torch.autocast(enabled=False)``
  inside an autocast forward (models keep their first or last layers, routers and
  norms out of low precision), so the autocast state differs between the segments
  of one forward; without autocast it changes nothing;
* ``frozen_first_layer``: the first layer runs under ``torch.no_grad()`` inside the
  training forward (a frozen bottom layer, as fine-tuning keeps early layers fixed),
  so grad mode differs between the segments of one forward: that layer's weights
  get no gradient, and a checkpoint must not make its output require grad.

Four more knobs give segments what real layers are full of, each off by default:

* ``nested_inputs``: each layer gets its tensors nested and by keyword,
  ``layer({"hidden": [x], "embedding": (x0,)}, key_padding_mask=mask, ...)``, as HF passes
  ``position_embeddings=(cos, sin)`` and pipelines pass lists of hidden states: no
  positional argument is a tensor;
* ``inplace_ops``: in-place operations inside the segments: embedding and residual
  dropout ``nn.Dropout(inplace=True)``, ``nn.ReLU(inplace=True)``, the manual attention
  path's scale and mask applied with ``mul_`` and ``masked_fill_`` on the scores right
  after their matmul, and the embedding mixed in with ``add_``;
* ``value_hooks``: hooks that change values, as adapters and interventions do: a LoRA
  delta added by a forward hook on ``attn.qkv`` and ``mlp.fc``, a pre-hook on each
  attention and MLP that rescales its input, and a forward hook on each layer that adds
  a steering vector to its output;
* ``outside_params``: parameters a segment reads but does not own: a projection held by
  the model that every layer's attention adds to its output projection (reached through a
  closure) and a gate per layer owned by the model that scales its MLP output.

One more gives segments the outputs library layers return, off (``plain``) by default:

* ``segment_outputs``: each layer (and group) returns its hidden state in a structure with
  ``None`` fields, which the model unpacks as library models do: a tuple ``(x, None)`` or
  ``(x, None, aux)`` read by position (``tuple-none``, as transformers' decoder layers return
  ``(hidden_states, attn_weights)``), a dict ``{"hidden_states": x, "attentions": None,
  "router_z_loss": aux}`` read by key (``dict``), a ``ModelOutput``-like dataclass
  (``dataclass``) or a named tuple (``namedtuple``) read by attribute. A checkpoint must
  hand back that structure, ``None`` fields included.

And one replaces the feed-forward, off (``0``) by default:

* ``moe_top_k``: each MLP is a mixture of experts (``MoE``): a router sends each token to its
  top 1 or 2 of four experts, with router jitter noise drawn from the RNG, a capacity per
  expert past which tokens are dropped, a shared expert every token goes through, a
  load-balancing loss and a z-loss attached to the activations by a custom autograd function
  (Megatron's ``MoEAuxLossAutoScaler``), and the tokens each expert took counted in a buffer,
  guarded per call so that a recompute does not count them again. A re-run one rounding step
  apart from its forward can send a token to another expert: a large gradient error, where a
  dense layer hides it within a tolerance.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import register_dataclass

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.granularity import (
    AttentionOnly,
    Granularity,
    LayerGroups,
    MlpOnly,
    layer_runs,
)
from gradequiv.models.segments import (
    RoutedModel,
    Router,
    Segment,
    attach_router,
    layer_segments,
)


def make_norm(config: TransformerConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=1e-5)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class DropPath(nn.Module):
    """Stochastic depth: drop a whole residual branch per sample."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device, dtype=x.dtype)
        return x * keep.bernoulli_(1.0 - self.p) / (1.0 - self.p)


class RandomSlopeReLU(nn.Module):
    """RReLU-like noise: negative inputs scaled by a random slope drawn per element.

    Unlike torch's RReLU (whose CPU kernel draws only for non-positive
    inputs), it draws for every element, so how far the random stream moves
    does not depend on the values: an RNG difference then always means a
    recompute fault, never a downstream echo of one.
    """

    def __init__(self, lower: float = 1 / 8, upper: float = 1 / 3) -> None:
        super().__init__()
        self.lower, self.upper = lower, upper

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return F.leaky_relu(x, (self.lower + self.upper) / 2)
        slope = torch.empty_like(x).uniform_(self.lower, self.upper)
        return torch.where(x >= 0, x, x * slope)


class Attention(nn.Module):
    router: Router

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.fused = config.attention == "sdpa"
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.attn_dropout)  # manual path only
        self.attn_dropout_p = config.attn_dropout  # fused path: SDPA's dropout_p
        self.inplace = config.inplace_ops
        self.resid_dropout = nn.Dropout(config.resid_dropout, inplace=config.inplace_ops)
        # Under ``outside_params``: the model's shared projection, reached through a closure.
        self.outside: Callable[[Tensor], Tensor] | None = None

    def forward(
        self, h: Tensor, key_padding_mask: Tensor | None, *, causal: bool = False
    ) -> Tensor:
        B, T, C = h.shape
        q, k, v = self.qkv(h).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        allowed = _allowed_keys(T, key_padding_mask, causal, h.device)  # (B|1, 1, T, T) bool
        if self.fused:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed,
                dropout_p=self.attn_dropout_p if self.training else 0.0,
            )
        else:
            scale = 1.0 / math.sqrt(k.size(-1))
            if self.inplace:  # in place on the matmul's output, as real kernels write it
                att = (q @ k.transpose(-2, -1)).mul_(scale)  # (B, nh, T, T)
                if allowed is not None:
                    att.masked_fill_(~allowed, float("-inf"))
            else:
                att = (q @ k.transpose(-2, -1)) * scale  # (B, nh, T, T)
                if allowed is not None:
                    att = att.masked_fill(~allowed, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        projected = self.proj(y)
        if self.outside is not None:
            # On y, not on h: a segment input read by two matmuls under autocast would be cast
            # once (a reentrant recompute's detached input is a leaf, whose cast autocast
            # caches) and once per use with full storage: both right, summed in other
            # precisions.
            projected = projected + self.outside(y)
        out: Tensor = self.resid_dropout(projected)
        return out


def _allowed_keys(
    T: int, key_padding_mask: Tensor | None, causal: bool, device: torch.device
) -> Tensor | None:
    """Boolean mask of the keys each query may attend to, or None for all."""
    allowed = None
    if causal:
        allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :]  # (B, 1, 1, T)
        allowed = keys if allowed is None else allowed & keys
        # A query whose keys are all padding would softmax to NaN: let it see itself.
        allowed = allowed | torch.eye(T, dtype=torch.bool, device=device)[None, None]
    return allowed


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass, as a recompute does: the autograd
    engine is running a graph task on this thread. torch has no public way to ask (pytorch
    issue 144928); torch's own ModTracker (``is_bw``) and DeepSpeed's ZeRO-3 recompute guard
    ask this."""
    return torch._C._current_graph_task_id() != -1


class RunningStats(nn.Module):
    """Statistics of the activations entering a layer's MLP, kept in buffers: batches and
    tokens seen (int64 counters, as BatchNorm's ``num_batches_tracked`` and an MoE router's
    tokens per expert) and a running mean of each channel (as BatchNorm's ``running_mean``).

    Every training-mode forward moves them, also under ``no_grad`` (a training forward
    whose loss is not backpropagated still saw its batch); eval forwards do not, and neither
    does a forward run again inside backward: a recompute repeats a forward, it sees no new
    batch. So a correct recompute leaves them exactly as full storage does, and one that
    loses the forward's update, or runs the forward again outside backward, does not.
    """

    num_batches_tracked: Tensor
    tokens_seen: Tensor
    running_mean: Tensor

    def __init__(self, width: int, momentum: float = 0.1) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("running_mean", torch.zeros(width))

    def forward(self, h: Tensor) -> None:
        if not self.training or recomputing():
            return
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.tokens_seen.add_(h.numel() // h.shape[-1])
            mean = h.detach().mean(dim=tuple(range(h.dim() - 1)))
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)


#: The feed-forward's activation module, by the config's ``activation``.
_ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU,
                                            "rrelu": RandomSlopeReLU, "swiglu": nn.SiLU}


class MLP(nn.Module):
    router: Router

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.stats = RunningStats(config.n_embd) if config.running_stats else None
        hidden = config.ffn_mult * config.n_embd
        self.swiglu = config.activation == "swiglu"
        self.fc = nn.Linear(config.n_embd, (2 if self.swiglu else 1) * hidden, bias=config.bias)
        self.act = (nn.ReLU(inplace=True) if config.activation == "relu" and config.inplace_ops
                    else _ACTIVATIONS[config.activation]())
        self.mlp_dropout = nn.Dropout(config.mlp_dropout)
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.resid_dropout, inplace=config.inplace_ops)
        # Under ``outside_params``: this layer's gate, owned by the model.
        self.outside_gate: Callable[[], Tensor] | None = None

    def forward(self, h: Tensor) -> Tensor:
        if self.stats is not None:
            self.stats(h)
        if self.swiglu:
            gate, up = self.fc(h).chunk(2, dim=-1)
            hidden = self.act(gate) * up
        else:
            hidden = self.act(self.fc(h))
        projected = self.proj(self.mlp_dropout(hidden))
        if self.outside_gate is not None:
            projected = projected * self.outside_gate()
        out: Tensor = self.resid_dropout(projected)
        return out


#: Experts per mixture-of-experts layer (``moe_top_k``), beside the shared one.
MOE_EXPERTS = 4
#: Tokens an expert takes per forward, as a multiple of an even share: the rest are dropped.
MOE_CAPACITY_FACTOR = 1.25
#: Router jitter: the router's input scaled by a factor drawn from U(1 - eps, 1 + eps).
MOE_JITTER = 0.05
#: The weights of the load-balancing loss (Switch Transformer) and the router z-loss (ST-MoE).
MOE_BALANCE_COEFF = 1e-2
MOE_Z_COEFF = 1e-3


class Expert(nn.Module):
    """One expert: the dense MLP's projections and activation; the shared expert keeps the
    dense MLP's dropout too (``mlp_dropout``), the routed ones none."""

    def __init__(self, config: TransformerConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.mlp_dropout = nn.Dropout(dropout)
        hidden = config.ffn_mult * config.n_embd
        self.swiglu = config.activation == "swiglu"
        self.fc = nn.Linear(config.n_embd, (2 if self.swiglu else 1) * hidden, bias=config.bias)
        self.act = _ACTIVATIONS[config.activation]()
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, h: Tensor) -> Tensor:
        if self.swiglu:
            gate, up = self.fc(h).chunk(2, dim=-1)
            hidden = self.act(gate) * up
        else:
            hidden = self.act(self.fc(h))
        out: Tensor = self.proj(self.mlp_dropout(hidden))
        return out


class AttachAuxLoss(torch.autograd.Function):
    """Hands ``output`` on unchanged and gives ``aux`` the gradient 1 in backward: the router's
    losses reach training without reaching the model's outputs (Megatron's
    ``MoEAuxLossAutoScaler``; DeepSpeed's and torchtitan's MoE attach theirs the same way)."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor) -> Tensor:
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class MoE(nn.Module):
    """A mixture-of-experts feed-forward in the place of ``MLP``: top-k routing over
    ``MOE_EXPERTS`` experts and a shared one, as Switch, GShard and DeepSeek-MoE route.

    Routing is decided in fp32 (``gate`` logits, softmax, ``topk``: a routing decision is
    discrete, so a re-run whose logits are one rounding step away from the forward's may send
    a token elsewhere); tokens past an expert's capacity are dropped, first choices before
    second ones, in token order; the chosen experts' outputs are weighted by the normalised
    router probabilities. The tokens each expert took are counted in ``tokens_per_expert`` by
    every training-mode forward and by no re-run of it inside backward, the guard real MoE
    code keeps for its load statistics."""

    tokens_per_expert: Tensor
    router: Router

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.top_k = config.moe_top_k
        self.stats = RunningStats(config.n_embd) if config.running_stats else None
        self.gate = nn.Linear(config.n_embd, MOE_EXPERTS, bias=False)
        # small, as real routers start (Mixtral's initializer_range): every expert is near
        # the top for many tokens, so routing is as sensitive as in training
        nn.init.normal_(self.gate.weight, std=0.02)
        self.experts = nn.ModuleList(Expert(config) for _ in range(MOE_EXPERTS))
        self.shared_expert = Expert(config, config.mlp_dropout)
        self.resid_dropout = nn.Dropout(config.resid_dropout, inplace=config.inplace_ops)
        self.register_buffer("tokens_per_expert", torch.zeros(MOE_EXPERTS, dtype=torch.long))
        # Under ``outside_params``: this layer's gate, owned by the model.
        self.outside_gate: Callable[[], Tensor] | None = None

    def forward(self, h: Tensor) -> Tensor:
        if self.stats is not None:
            self.stats(h)
        shape = h.shape
        tokens = h.reshape(-1, shape[-1])
        routed = tokens
        if self.training:  # router jitter noise (Switch Transformer), from the RNG
            noise = torch.empty_like(tokens).uniform_(1.0 - MOE_JITTER, 1.0 + MOE_JITTER)
            routed = tokens * noise
        logits = self.gate(routed).float()  # (N, E)
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        kept = _within_capacity(chosen)  # (N, k)
        routed_to = chosen.masked_fill(~kept, -1)  # a dropped choice goes to no expert
        scale = weights.to(tokens.dtype)
        out = self.shared_expert(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(routed_to == e, as_tuple=True)
            if rows.numel():
                given = expert(tokens[rows]) * scale[rows, slot, None]
                out = out.index_add(0, rows, given.to(out.dtype))
        out = out.reshape(shape)
        if self.outside_gate is not None:
            out = out * self.outside_gate()
        result: Tensor = self.resid_dropout(out)
        if self.training:
            self._count(chosen, kept)
            # last: what the Function hands on is a view of its input, which nothing may
            # change in place (an in-place dropout after it would be refused)
            result = AttachAuxLoss.apply(  # type: ignore[no-untyped-call]  # untyped in torch
                result, _router_losses(logits, probs, chosen))
        return result

    def _count(self, chosen: Tensor, kept: Tensor) -> None:
        if recomputing():  # a re-run repeats a forward: it routes no new tokens
            return
        with torch.no_grad():
            self.tokens_per_expert.add_(torch.bincount(chosen[kept], minlength=MOE_EXPERTS))


def _within_capacity(chosen: Tensor) -> Tensor:
    """Which of each token's choices its expert takes: each expert takes
    ``MOE_CAPACITY_FACTOR`` times an even share of the choices, first choices of every
    token before second ones, in token order (GShard's priority); the rest are dropped."""
    n, k = chosen.shape
    capacity = math.ceil(MOE_CAPACITY_FACTOR * n * k / MOE_EXPERTS)
    one_hot = F.one_hot(chosen.t().reshape(-1), MOE_EXPERTS)  # (k * N, E), by choice rank
    position = one_hot.cumsum(dim=0) * one_hot  # 1-based place in its expert's queue
    kept = (position.sum(dim=-1) <= capacity).reshape(k, n).t()
    return kept


def _router_losses(logits: Tensor, probs: Tensor, chosen: Tensor) -> Tensor:
    """The load-balancing loss (the share of choices each expert got times its mean router
    probability, Switch Transformer) and the router z-loss (ST-MoE), weighted, in fp32."""
    share = F.one_hot(chosen, MOE_EXPERTS).float().mean(dim=(0, 1))  # (E,)
    balance = MOE_EXPERTS * (share * probs.mean(dim=0)).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return MOE_BALANCE_COEFF * balance + MOE_Z_COEFF * z


class Block(nn.Module):
    """One layer. Its sub-blocks also go through the router (attention/MLP-only granularity)."""

    router: Router

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.norm_1 = make_norm(config)
        self.attn = Attention(config)
        self.norm_2 = make_norm(config)
        self.mlp: MLP | MoE = MoE(config) if config.moe_top_k else MLP(config)
        self.drop_path = DropPath(config.drop_path)
        # How much of the embedding is mixed back in; 1-D, as FSDP shards no 0-dim parameter.
        self.x0_gate = nn.Parameter(torch.full((1,), 0.1))
        # An MoE router's logits, only for their z-loss (no experts): a second output that
        # reaches the loss. Not named ``router``, the attribute the recompute router holds.
        self.expert_router = (nn.Linear(config.n_embd, 4, bias=False)
                              if config.aux_loss else None)
        # Set on the model's last block under ``fp32_last_layer``: whoever calls this block
        # (the model, or the group it is in) calls it with autocast disabled.
        self.autocast_off = False
        # Set on the model's first block under ``frozen_first_layer``: called under no_grad.
        self.grad_off = False
        self.inplace = config.inplace_ops
        self.outputs = config.segment_outputs

    def forward(
        self,
        x: Tensor | dict[str, Any],
        x0: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        *,
        causal: bool = False,
        residual_scale: float = 1.0,
    ) -> Any:
        hidden, embedding = _unnest(x, x0)
        x, aux = self._layer(hidden, embedding, key_padding_mask, causal=causal,
                             residual_scale=residual_scale)
        return pack_outputs(self.outputs, x, aux)

    def _layer(self, x: Tensor, x0: Tensor, key_padding_mask: Tensor | None, *, causal: bool,
               residual_scale: float) -> tuple[Tensor, Tensor | None]:
        if self.inplace:
            x = torch.mul(self.x0_gate, x0).add_(x)
        else:
            x = x + self.x0_gate * x0
        aux = None if self.expert_router is None else _z_loss(self.expert_router(x))
        if self.pre_norm:
            a = self.router(self.attn, self.norm_1(x), key_padding_mask, causal=causal)
            x = x + residual_scale * self.drop_path(a)
            m = self.router(self.mlp, self.norm_2(x))
            x = x + residual_scale * self.drop_path(m)
        else:
            a = self.router(self.attn, x, key_padding_mask, causal=causal)
            x = self.norm_1(x + residual_scale * self.drop_path(a))
            m = self.router(self.mlp, x)
            x = self.norm_2(x + residual_scale * self.drop_path(m))
        return x, aux


#: What a segment (a layer, a group of layers) returns its hidden state in, ``plain`` first:
#: the tensor (``(x, aux)`` with an aux loss), or a structure with ``None`` fields.
SEGMENT_OUTPUTS = ("plain", "tuple-none", "dict", "dataclass", "namedtuple")


@dataclass
class LayerOutput:
    """A layer's outputs as a ``ModelOutput``-like dataclass: fields not computed are None."""

    hidden_states: Tensor
    attentions: Tensor | None = None
    router_z_loss: Tensor | None = None


# As transformers registers its ModelOutput classes: torch's pytree walks into it.
register_dataclass(LayerOutput)


class LayerOutputTuple(NamedTuple):
    """A layer's outputs as a named tuple, with the same fields."""

    hidden_states: Tensor
    attentions: Tensor | None
    router_z_loss: Tensor | None


def pack_outputs(kind: str, x: Tensor, aux: Tensor | None) -> Any:
    """A segment's hidden state ``x`` and aux loss (None without one) as ``kind`` returns
    them (``SEGMENT_OUTPUTS``); the attention weights are never computed: None."""
    if kind == "tuple-none":
        return (x, None) if aux is None else (x, None, aux)
    if kind == "dict":
        return {"hidden_states": x, "attentions": None, "router_z_loss": aux}
    if kind == "dataclass":
        return LayerOutput(x, None, aux)
    if kind == "namedtuple":
        return LayerOutputTuple(x, None, aux)
    return x if aux is None else (x, aux)


def unpack_outputs(kind: str, out: Any) -> tuple[Tensor, Tensor | None]:
    """The hidden state and aux loss out of what a segment returned, read as library models
    read their layers' outputs: by position (``layer_outputs[0]``), key or attribute."""
    if kind == "tuple-none":
        return out[0], out[2] if len(out) > 2 else None
    if kind == "dict":
        return out["hidden_states"], out["router_z_loss"]
    if kind in ("dataclass", "namedtuple"):
        return out.hidden_states, out.router_z_loss
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


def _with_hidden(out: Any, x: Tensor) -> Any:
    """``out`` (any of ``SEGMENT_OUTPUTS``) with its hidden state replaced by ``x``."""
    if isinstance(out, dict):
        return {**out, "hidden_states": x}
    if isinstance(out, LayerOutput):
        return replace(out, hidden_states=x)
    if isinstance(out, LayerOutputTuple):
        return out._replace(hidden_states=x)
    if isinstance(out, tuple):
        return (x, *out[1:])
    return x


def _z_loss(router_logits: Tensor) -> Tensor:
    """The router z-loss (ST-MoE), in fp32 as under autocast its logsumexp would overflow."""
    return 1e-2 * torch.logsumexp(router_logits.float(), dim=-1).square().mean()


def _unnest(x: Tensor | dict[str, Any], x0: Tensor | None) -> tuple[Tensor, Tensor]:
    """``x`` and ``x0`` out of a layer's arguments, passed plainly or nested
    (``nested_inputs``: ``{"hidden": [x], "embedding": (x0,)}``)."""
    if isinstance(x, dict):
        (hidden,), (x0,) = x["hidden"], x["embedding"]
    else:
        hidden = x
    assert isinstance(hidden, Tensor) and isinstance(x0, Tensor)
    return hidden, x0


def _plain_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def _run_layer(
    call: Callable[..., Any],
    layer: nn.Module,
    x: Tensor,
    x0: Tensor,
    key_padding_mask: Tensor | None,
    *,
    x0_keyword: bool,
    causal: bool,
    residual_scale: float,
    nested: bool = False,
    outputs: str = "plain",
) -> tuple[Tensor, Tensor | None]:
    """One layer (or group) through ``call``, ``x0`` by position or keyword (``nested``: both
    streams nested in a dict of a list and a tuple, the mask by keyword), with autocast
    disabled for a block marked ``autocast_off`` and grad mode off for one marked
    ``grad_off``; its new residual stream and its aux loss (None without one), read out of
    what it returned as ``outputs`` (``SEGMENT_OUTPUTS``) says."""
    precision: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if getattr(layer, "autocast_off", False):
        precision = torch.autocast(x.device.type, enabled=False)
    grad_mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if getattr(layer, "grad_off", False):
        grad_mode = torch.no_grad()
    with precision, grad_mode:
        if nested:
            out = call(layer, {"hidden": [x], "embedding": (x0,)},
                       key_padding_mask=key_padding_mask, causal=causal,
                       residual_scale=residual_scale)
        elif x0_keyword:  # the mask follows x0 in the signature, so it goes by keyword too
            out = call(layer, x, x0=x0, key_padding_mask=key_padding_mask, causal=causal,
                       residual_scale=residual_scale)
        else:
            out = call(layer, x, x0, key_padding_mask, causal=causal,
                       residual_scale=residual_scale)
    return unpack_outputs(outputs, out)


def _add(total: Tensor | None, aux: Tensor | None) -> Tensor | None:
    if aux is None:
        return total
    return aux if total is None else total + aux


class LayerGroup(nn.Module):
    """Consecutive layers run as one segment (kept out of the model's state_dict).

    It calls its layers as the model would (``x0`` by keyword under
    ``x0_keyword``) and, under ``aux_loss``, returns their summed aux with ``x``, in the
    structure its layers return (``segment_outputs``).
    """

    def __init__(self, blocks: list[Block], *, x0_keyword: bool = False,
                 nested: bool = False, outputs: str = "plain") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.x0_keyword = x0_keyword
        self.nested = nested
        self.outputs = outputs

    def forward(
        self,
        x: Tensor | dict[str, Any],
        x0: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        *,
        causal: bool = False,
        residual_scale: float = 1.0,
    ) -> Any:
        x, x0 = _unnest(x, x0)
        aux_total: Tensor | None = None
        for block in self.blocks:
            x, aux = _run_layer(_plain_call, block, x, x0, key_padding_mask,
                                x0_keyword=self.x0_keyword, causal=causal,
                                residual_scale=residual_scale, nested=self.nested,
                                outputs=self.outputs)
            aux_total = _add(aux_total, aux)
        return pack_outputs(self.outputs, x, aux_total)


#: The element-wise dropout sites, by config field, with the name a report gives each.
_ELEMENT_DROPOUT = {
    "embd_dropout": "embedding dropout",
    "attn_dropout": "attention dropout",
    "resid_dropout": "residual dropout",
    "mlp_dropout": "MLP dropout",
}
#: Every random site of the transformer drawn with a probability: config field -> the name a
#: report gives it. Stochastic depth drops whole residual branches per sample; the RReLU-like
#: activation (``activation="rrelu"``) is the one random op that is no probability.
DROPOUT_SITES: dict[str, str] = _ELEMENT_DROPOUT | {"drop_path": "drop-path"}
#: The sites "all dropout on" turns on: every one but stochastic depth.
ELEMENT_DROPOUT_SITES = tuple(_ELEMENT_DROPOUT)


@dataclass(frozen=True)
class TransformerConfig:
    n_layer: int = 2
    n_embd: int = 32
    n_head: int = 2
    ffn_mult: int = 4
    vocab_size: int = 64
    max_seq_len: int = 64
    embd_dropout: float = 0.0
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    mlp_dropout: float = 0.0
    drop_path: float = 0.0  # stochastic depth on both residual branches
    attention: Literal["sdpa", "manual"] = "sdpa"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_position: Literal["pre", "post"] = "pre"
    activation: Literal["gelu", "relu", "rrelu", "swiglu"] = "gelu"  # rrelu: random slopes
    tie_embeddings: bool = True
    bias: bool = True
    freeze_embeddings: bool = False  # then no layer input requires grad (as with adapters/LoRA)
    aux_loss: bool = False  # each layer returns (x, an MoE-router z-loss); the loss adds them
    layer_repeats: int = 1  # weight sharing: each segment called this many times per forward
    x0_keyword: bool = False  # x0 reaches each layer by keyword (a grad-needing kwarg)
    running_stats: bool = False  # each MLP keeps counters and a running mean in buffers
    fp32_last_layer: bool = False  # the last layer runs with autocast disabled
    frozen_first_layer: bool = False  # the first layer runs under torch.no_grad()
    nested_inputs: bool = False  # layers get x and x0 nested in a dict, the mask by keyword
    inplace_ops: bool = False  # in-place dropout, ReLU, score scaling and masking, add_
    value_hooks: bool = False  # LoRA, input-rescaling and steering hooks change values
    outside_params: bool = False  # layers read a projection and gates the model owns
    # what each layer returns: the tensor, or a structure with None fields (SEGMENT_OUTPUTS)
    segment_outputs: Literal["plain", "tuple-none", "dict", "dataclass", "namedtuple"] = "plain"
    moe_top_k: int = 0  # 1 or 2: each MLP a mixture of experts routing each token to its top k

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "ffn_mult", "vocab_size", "max_seq_len",
                     "layer_repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name}={value!r}: must be a whole number >= 1")
        if self.moe_top_k not in (0, 1, 2):
            raise InvalidArgument(f"moe_top_k={self.moe_top_k!r}: must be 0 (a dense MLP), 1 "
                                  f"or 2 (experts each token is routed to)")
        for name in ("aux_loss", "x0_keyword", "running_stats", "fp32_last_layer",
                     "frozen_first_layer", "nested_inputs", "inplace_ops", "value_hooks",
                     "outside_params"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidArgument(f"{name}={value!r}: must be true or false")
        if self.n_embd % self.n_head:
            raise InvalidArgument(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"pick n_head among the divisors of n_embd"
            )
        for name in DROPOUT_SITES:
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise InvalidArgument(f"{name}={p!r}: a probability in [0, 1) is needed")
        _check_choice("attention", self.attention, ("sdpa", "manual"))
        _check_choice("norm", self.norm, ("layernorm", "rmsnorm"))
        _check_choice("norm_position", self.norm_position, ("pre", "post"))
        _check_choice("activation", self.activation, ("gelu", "relu", "rrelu", "swiglu"))
        _check_choice("segment_outputs", self.segment_outputs, SEGMENT_OUTPUTS)

    @property
    def has_randomness(self) -> bool:
        return (self.activation == "rrelu" or self.moe_top_k > 0  # router jitter
                or any(getattr(self, p) > 0 for p in DROPOUT_SITES))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidArgument(f"{name}={value!r} is not one of {', '.join(choices)}")


def _shared_projection(shared: nn.Linear, h: Tensor) -> Tensor:
    """The model's projection of a layer's attention values (``outside_params``), in the
    weight's precision with autocast off: autocast would cast the shared weight once for the
    whole forward, so that full storage sums its layers' gradients in bf16 where a recompute
    that casts it per segment sums them in fp32 (both right, as with a layer applied twice)."""
    with torch.autocast(h.device.type, enabled=False):
        return F.linear(h.to(shared.weight.dtype), shared.weight).to(h.dtype)


def _gate(gates: nn.Parameter, i: int) -> Tensor:
    """Layer ``i``'s MLP gate out of the model's vector (``outside_params``)."""
    return gates[i]


#: How much the attention and MLP pre-hooks scale their input (``value_hooks``).
HOOK_INPUT_SCALE = 0.75
_LORA_RANK = 2


def _lora(linear: nn.Linear, rank: int) -> None:
    """A LoRA pair on ``linear`` (its ``lora_a``, ``lora_b``), added to its output by a
    forward hook, as hook-based adapters do."""
    linear.register_parameter("lora_a", nn.Parameter(torch.randn(rank, linear.in_features) * 0.1))
    linear.register_parameter("lora_b",
                              nn.Parameter(torch.randn(linear.out_features, rank) * 0.1))
    linear.register_forward_hook(_lora_delta)


def _lora_delta(linear: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
    # read as attributes, as real adapters do: get_parameter reads through named_modules,
    # which torch.func.functional_call's stand-in tensors are not found in
    lora_a, lora_b = cast("Tensor", linear.lora_a), cast("Tensor", linear.lora_b)
    return out + F.linear(F.linear(args[0], lora_a), lora_b)


def _rescale_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * HOOK_INPUT_SCALE, *args[1:])


def _steer(block: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
    """Add the layer's steering vector to its hidden state (beside an aux loss, if any)."""
    steering = cast("Tensor", block.steering)
    x, _ = unpack_outputs(cast("Block", block).outputs, out)
    return _with_hidden(out, x + steering)


def _add_value_hooks(block: Block, config: TransformerConfig) -> None:
    """The ``value_hooks`` of one layer: LoRA on ``attn.qkv`` and ``mlp.fc``, a pre-hook
    that rescales the attention's and the MLP's input, a steering vector added to the
    layer's output."""
    _lora(block.attn.qkv, _LORA_RANK)
    mlp = block.mlp
    _lora(mlp.fc if isinstance(mlp, MLP) else mlp.shared_expert.fc, _LORA_RANK)
    block.attn.register_forward_pre_hook(_rescale_input)
    block.mlp.register_forward_pre_hook(_rescale_input)
    block.register_parameter("steering", nn.Parameter(torch.randn(config.n_embd) * 0.1))
    block.register_forward_hook(_steer)


class Transformer(RoutedModel):
    router: Router

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
        self.embd_dropout = nn.Dropout(config.embd_dropout, inplace=config.inplace_ops)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        cast("Block", self.blocks[-1]).autocast_off = config.fp32_last_layer
        cast("Block", self.blocks[0]).grad_off = config.frozen_first_layer
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if config.freeze_embeddings:
            self.wte.weight.requires_grad_(False)
            self.wpe.weight.requires_grad_(False)
        self.residual_scale = 1.0 / math.sqrt(2.0 * config.n_layer)
        self._groups: list[LayerGroup] = []  # plain list: never in the state_dict
        # Made last, so that every other weight is the same with the knobs on or off.
        if config.outside_params:
            self._reach_outside(config)
        if config.value_hooks:
            for block in self.blocks:
                _add_value_hooks(cast("Block", block), config)
        attach_router(self)

    def _reach_outside(self, config: TransformerConfig) -> None:
        """Give each layer parameters it reads and the model owns: one projection shared by
        every attention (through a closure, as a captured weight is) and a gate per layer
        for the MLP output (read by index out of the model's vector)."""
        self.shared_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        nn.init.normal_(self.shared_proj.weight, std=0.02)
        self.mlp_gates = nn.Parameter(torch.linspace(0.8, 1.2, config.n_layer))
        for i, block in enumerate(cast("list[Block]", list(self.blocks))):
            block.attn.outside = functools.partial(_shared_projection, self.shared_proj)
            block.mlp.outside_gate = functools.partial(_gate, self.mlp_gates, i)

    def segments(self, granularity: Granularity) -> list[Segment]:
        """The modules that recompute under ``granularity``, in call order."""
        blocks = cast("list[Block]", list(self.blocks))  # the stubs' ModuleList holds Modules
        self._groups = []
        if isinstance(granularity, LayerGroups):
            return [self._group(blocks, run) for run in layer_runs(granularity, len(blocks))]
        parts: list[tuple[str, nn.Module]]
        if isinstance(granularity, AttentionOnly):
            parts = [(f"blocks.{i}.attn", b.attn) for i, b in enumerate(blocks)]
        elif isinstance(granularity, MlpOnly):
            parts = [(f"blocks.{i}.mlp", b.mlp) for i, b in enumerate(blocks)]
        else:
            parts = [(f"blocks.{i}", b) for i, b in enumerate(blocks)]
        return layer_segments(granularity, parts)

    def _group(self, blocks: list[Block], run: range) -> Segment:
        """Layers ``run`` as one segment, which forward then runs in place of its members."""
        members = blocks[run.start:run.stop]
        group = LayerGroup(members, x0_keyword=self.config.x0_keyword,
                           nested=self.config.nested_inputs,
                           outputs=self.config.segment_outputs)
        object.__setattr__(group, "router", self.router)
        self._groups.append(group)
        return Segment(f"blocks.{run.start}-{run.stop - 1}", group, tuple(members))

    def forward(
        self, tokens: Tensor, key_padding_mask: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The logits; under ``aux_loss``, ``(logits, the aux of every layer call summed)``."""
        B, T = tokens.shape
        if T > self.config.max_seq_len:
            raise InvalidArgument(
                f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}; "
                f"raise max_seq_len or shorten the batch"
            )
        pos = torch.arange(T, device=tokens.device)
        x0 = self.embd_dropout(self.wte(tokens) + self.wpe(pos))  # (B, T, C)
        x = x0
        layers: Sequence[nn.Module] = self._groups if self._groups else list(self.blocks)
        aux_total: Tensor | None = None
        for layer in layers:
            for _ in range(self.config.layer_repeats):
                x, aux = _run_layer(self.router, layer, x, x0, key_padding_mask,
                                    x0_keyword=self.config.x0_keyword, causal=True,
                                    residual_scale=self.residual_scale,
                                    nested=self.config.nested_inputs,
                                    outputs=self.config.segment_outputs)
                aux_total = _add(aux_total, aux)
        logits: Tensor = self.lm_head(self.norm_f(x))  # (B, T, vocab)
        return logits if aux_total is None else (logits, aux_total)
