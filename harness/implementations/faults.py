"""Deliberately broken recompute implementations: one correct checkpoint, one switch per fault.

``reference_checkpoint`` is a plain, correct recompute (an autograd.Function: forward
under no_grad keeping only the inputs, backward re-running the segment with the RNG state,
autocast state and keyword arguments of the first run, buffers put back). Every tensor of
the arguments, at the top level, by keyword or nested in lists, tuples and dicts, is an
input of the Function, and so are the segment's parameters and every parameter the first
run read that its module does not own (a shared projection, a gate the model owns, a
weight in a closure: found by a TorchFunctionMode over that run, which is why the first
run happens before the Function is applied and the Function's forward only hands its
outputs over). Backward returns their gradients from ``torch.autograd.grad``: it never
writes ``.grad`` itself, so it composes with ``torch.autograd.grad(loss, ...)`` and with
gradient accumulation, and a tensor passed by keyword gets its gradient. Every output
tensor, in a tuple, a dict, a dataclass or a named tuple, gets its incoming gradient, and
the outputs come back in the structure the segment returned them in, ``None`` fields
included. Under ``create_graph=True`` (grad mode on in backward) it recomputes on views of
the saved inputs and parameters, which keep their graph, and takes the gradients with
``create_graph``, so that they can be differentiated again (a gradient penalty); it claims
no ``create-graph`` all the same: its second backward runs through another graph than full
storage's and sums in another order (relative errors of a few 1e-6 in fp32, of bf16's
rounding in bf16), where torch's non-reentrant checkpoint, which backpropagates through
the forward's own graph, is bitwise equal.
Each mutant flips one :class:`Faults` switch; each switch is a failure seen in real
recompute code (``Mutant.source``: the issue or pull request it stands for, where one
is known). A harness that lets any of them pass is broken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass(frozen=True)
class Faults:
    """One switch per fault; all off is the correct checkpoint."""

    no_rng_restore: bool = False  # the recompute draws fresh dropout masks
    rng_lost_on_first_call: bool = False  # state captured lazily: the first recompute misses it
    rng_captured_late: bool = False  # RNG state saved after the forward ran, not before
    reseeded: bool = False  # recompute seeds a fixed value instead of restoring the state
    caller_stream_moved: bool = False  # restores for the recompute, never gives the caller's back
    caller_stream_moved_once: bool = False  # the same, on each segment's first recompute only
    cuda_rng_not_restored: bool = False  # CPU state restored, the CUDA generator's not
    dropout_off: bool = False  # recompute runs the segment in eval mode
    autocast_lost: bool = False  # recompute runs outside the caller's autocast
    rerun_other_attention_kernel: bool = False  # recompute outside the forward's SDPA
    #                                             backend choice: another kernel, other rounding
    kwargs_dropped: bool = False  # keyword arguments reach the first run only
    input_grads_dropped: bool = False  # only the first input gets its gradient
    inputs_detached: bool = False  # segment run on detached inputs: no gradient reaches them
    stale_recompute: bool = False  # later steps recompute from the first step's inputs
    no_op: bool = False  # keeps every activation: nothing recomputed, nothing saved
    padding_zeroed: bool = False  # forward writes zeros at padded positions (an unpadding path)
    gradient_skew: bool = False  # gradients through the segment off by a relative 1e-4
    buffers_updated_twice: bool = False  # recompute updates running statistics again
    crash_in_backward: bool = False  # backward raises
    autocast_default_dtype: bool = False  # recompute re-enters autocast without its dtype
    autocast_forced_on: bool = False  # recompute enters autocast though the forward had none
    grad_via_backward: bool = False  # inner torch.autograd.backward writes .grad
    accumulated_grad_overwritten: bool = False  # param grads read by clearing .grad: earlier
    #                                             micro-batches' gradients lost
    kwarg_tensors_detached: bool = False  # tensor kwargs held by closure, detached
    tuple_tail_no_grad: bool = False  # only a tuple output's first tensor gets its gradient
    state_per_module_slot: bool = False  # RNG/autocast state kept in one slot per module
    state_queue_without_backward: bool = False  # per-module FIFO of states, popped by backward
    recomputed_kept: bool = False  # recomputed outputs (and so activations) kept after backward
    saved_inputs_kept: bool = False  # saved boundary inputs appended to a list never cleared
    large_boundary_compressed: bool = False  # inputs over 64K elements saved in bfloat16
    group_layers_unchained: bool = False  # a group's layers all fed the group's input
    bn_stats_in_recompute_only: bool = False  # running statistics frozen in the forward,
    #                                           updated by the recompute
    grads_without_graph: bool = False  # backward's gradients taken without create_graph, on
    #                                    detached inputs: no second-order term through it
    autocast_latched: bool = False  # autocast state kept in one process-wide slot: the last
    #                                 segment's forward decides every recompute's
    stash_kept_after_warmup: bool = False  # from a segment's first backward on, its saved
    #                                        inputs also go to a stash nobody clears
    grad_mode_forced_on: bool = False  # the forward runs under enable_grad whatever the
    #                                    caller's grad mode: a no_grad segment builds a graph
    nested_tensors_no_grad: bool = False  # only top-level tensor arguments are Function
    #                                       inputs: tensors nested in lists, tuples and dicts
    #                                       get no gradient
    rng_devices_from_positional: bool = False  # RNG saved and restored for the devices of
    #                                            the top-level positional tensors only
    autocast_device_from_first_arg: bool = False  # autocast state read for the first
    #                                               positional argument's device ("cuda"
    #                                               when it is no tensor)
    matmul_outputs_cached: bool = False  # matmul outputs kept by reference in the forward
    #                                      and handed back in the recompute: an in-place op
    #                                      on them is applied twice
    hooks_skipped_in_recompute: bool = False  # recompute through module.forward: the
    #                                           segment's own hooks do not run again
    hooks_run_twice: bool = False  # the segment's forward hooks applied again around a
    #                                call that already ran them
    outside_params_no_grad: bool = False  # parameters the segment reads but its module does
    #                                       not own get no gradient
    outside_params_grad_doubled: bool = False  # those parameters get their gradient from
    #                                            the Function and again in .grad
    recomputed_held_to_backward_end: bool = False  # what each recompute saves stays alive
    #                                                until the whole backward ends
    autocast_off_not_restored: bool = False  # autocast re-entered where the forward had it,
    #                                          the ambient state kept where it had none: a
    #                                          backward inside autocast re-runs in it
    boundary_per_module_slot: bool = False  # saved inputs kept in one slot per module: the
    #                                         last forward's, when several are in flight
    state_per_module_stack: bool = False  # RNG/autocast states in a per-module LIFO stack,
    #                                       pushed by forward, popped by backward
    host_pool_of_three: bool = False  # saved inputs copied into three host buffers per
    #                                   module, indexed by the calls awaiting backward
    input_leaves_grad_kept: bool = False  # the detached input leaves made once in forward:
    #                                       each backward pass adds into their .grad
    rng_state_consumed_by_backward: bool = False  # the first backward pass takes the RNG
    #                                               state: a second re-runs with fresh draws
    saved_inputs_freed_after_backward: bool = False  # saved inputs released by the first
    #                                                  backward pass: a second returns None
    trainable_params_cached: bool = False  # a segment's trainable parameters read at its
    #                                        first call: those unfrozen later get no gradient
    trainable_cached_per_process: bool = False  # whether segments have trainable parameters
    #                                             decided once per process, by the first call:
    #                                             a frozen first layer freezes every layer
    frozen_segment_no_grad: bool = False  # a segment with no trainable parameter run under
    #                                       no_grad: no gradient reaches its input
    none_outputs_dropped: bool = False  # outputs repacked from their values that are not
    #                                     None: a dict loses its None fields, a tuple with
    #                                     None shortens, a dataclass or named tuple comes
    #                                     back a plain tuple


@dataclass(frozen=True)
class Mutant:
    name: str
    faults: Faults
    models: str  # the real failure it stands for
    cuda_only: bool = False
    source: str = ""  # the issue or pull request it stands for ("" where none is known)
    supports: tuple[str, ...] = ()  # opt-in grad modes it claims (``gradequiv_supports``)

    @property
    def impl(self) -> Callable[..., Any]:
        fn = functools.update_wrapper(
            functools.partial(checkpoint_with_faults, faults=self.faults), checkpoint_with_faults
        )
        fn.__name__ = fn.__qualname__ = self.name.replace("-", "_")
        fn.__doc__ = f"{self.models} ({self.source})" if self.source else self.models
        if self.supports:
            fn.gradequiv_supports = self.supports  # type: ignore[attr-defined]
        return fn


def _mutant(switch: str, models: str, source: str = "", cuda_only: bool = False,
            supports: tuple[str, ...] = ()) -> Mutant:
    return Mutant(switch.replace("_", "-"), Faults(**{switch: True}), models, cuda_only, source,
                  supports)


_PT = "https://github.com/pytorch/pytorch"
_MEGATRON = "https://github.com/NVIDIA/Megatron-LM"
_DEEPSPEED = "https://github.com/deepspeedai/DeepSpeed"
_FAIRSCALE = "https://github.com/facebookresearch/fairscale"

MUTANTS: tuple[Mutant, ...] = (
    _mutant("no_rng_restore", "checkpoint with preserve_rng_state=False around dropout",
            "https://github.com/allenai/OLMo-core/pull/828"),
    _mutant("rng_lost_on_first_call", "RNG state saved lazily on first use, so each "
                                      "segment's first recompute draws fresh masks (a "
                                      "device generator not yet seen as initialised)",
            "https://github.com/MooreThreads/torch_musa/issues/150"),
    _mutant("rng_captured_late", "RNG state captured after the segment ran, as in code that "
                                 "saves state lazily on first backward: the forward and its "
                                 "re-run start from other states",
            "https://github.com/pytorch/xla/pull/4690"),
    _mutant("reseeded", "recompute calls manual_seed(fixed) instead of restoring the state "
                        "(a recomputed dropout given a seed of its own, not the forward's)",
            "https://github.com/microsoft/onnxruntime/pull/19715"),
    _mutant("caller_stream_moved", "set_rng_state for the recompute without fork_rng: the "
                                   "caller's stream is left where the recompute put it",
            f"{_PT}/pull/14253"),
    _mutant("caller_stream_moved_once", "the caller's stream moved by a segment's first "
                                        "recompute only (a warm-up path without fork_rng)",
            f"{_PT}/pull/14253"),
    _mutant("cuda_rng_not_restored", "only torch.get_rng_state() saved; the device generator "
                                     "that feeds dropout is not restored",
            f"{_PT}/pull/194478", cuda_only=True),
    _mutant("dropout_off", "recompute under model.eval() or with dropout disabled"),
    _mutant("autocast_lost", "recompute outside the forward's autocast region (Megatron's "
                             "CheckpointFunction outside fp8_autocast)", f"{_MEGATRON}/pull/7538"),
    _mutant("rerun_other_attention_kernel", "recompute outside the forward's attention-backend "
                                            "choice (sdpa_kernel): the re-run computes "
                                            "attention with another kernel, one rounding "
                                            "step apart, which sends tokens of a mixture of "
                                            "experts to other experts",
            "https://github.com/NVIDIA-NeMo/Automodel/pull/2761"),
    _mutant("kwargs_dropped", "keyword arguments not forwarded to the recompute (an "
                              "attention mask ignored under checkpointing)",
            "https://github.com/lightly-ai/lightly/issues/2049"),
    _mutant("input_grads_dropped", "backward returns None for all inputs but the first",
            "https://github.com/ooples/AiDotNet.Tensors/pull/643"),
    _mutant("inputs_detached", "inputs detached before the segment: no gradient flows back, "
                               "the layers before it never train", f"{_PT}/issues/42812"),
    _mutant("stale_recompute", "recompute reuses the boundary saved on the first step"),
    _mutant("no_op", "a 'checkpoint' that just calls the function: no memory saved "
                     "(checkpointing switched on and never applied)",
            "https://github.com/verl-project/verl/issues/26"),
    _mutant("padding_zeroed", "an unpadding fast path that returns zeros at padded positions: "
                              "outputs differ only where the loss does not look",
            "https://github.com/huggingface/transformers/issues/27050"),
    _mutant("gradient_skew", "a small systematic error in the recomputed gradient"),
    _mutant("buffers_updated_twice", "BatchNorm running statistics updated by the recompute",
            f"{_PT}/issues/96136"),
    _mutant("crash_in_backward", "backward raises (freed buffer, shape bug: 'backward "
                                 "through the graph a second time')",
            "https://github.com/unslothai/unsloth/issues/3592"),
    _mutant("autocast_default_dtype", "the recompute re-enters autocast with only `enabled` "
                                      "(fairscale #1199 too): fp16 autocast on the CPU, whose "
                                      "default is bf16, recomputes in bf16",
            f"{_PT}/issues/71124"),
    _mutant("autocast_forced_on", "`fp8 is not None` where `bool(fp8)` was meant: every "
                                  "recompute enters the low-precision context, also when the "
                                  "forward ran without it", f"{_MEGATRON}/pull/4469"),
    _mutant("grad_via_backward", "the reentrant recompute's inner torch.autograd.backward "
                                 "writes parameter .grad, which torch.autograd.grad(loss, ...) "
                                 "must leave alone (pytorch #81296 too)", f"{_PT}/issues/51743"),
    _mutant("accumulated_grad_overwritten", "parameter gradients read back from .grad after an "
                                            "inner backward that cleared it first: the earlier "
                                            "micro-batches' gradients are lost",
            "https://github.com/unslothai/unsloth-zoo/pull/892"),
    _mutant("kwarg_tensors_detached", "tensor keyword arguments captured by a closure, not "
                                      "Function inputs: no gradient reaches them (DeepSpeed "
                                      "PR 8182 too)", f"{_MEGATRON}/pull/4765"),
    _mutant("tuple_tail_no_grad", "only the first tensor of a tuple output carries gradient "
                                  "back: an aux loss returned beside x trains nothing",
            f"{_PT}/issues/124725"),
    _mutant("state_per_module_slot", "RNG and autocast state kept in one slot per module: a "
                                     "weight-shared layer applied twice recomputes its first "
                                     "application with the second's dropout masks",
            f"{_DEEPSPEED}/issues/2103"),
    _mutant("state_queue_without_backward", "a per-module queue of saved RNG states, pushed by "
                                            "each forward and popped by backward: forwards "
                                            "without backward (eval, no_grad) leave stale "
                                            "entries the next recompute restores",
            f"{_DEEPSPEED}/pull/3005"),
    _mutant("recomputed_kept", "recomputed activations stay referenced after backward, so "
                               "recompute saves no memory and leaks (pytorch #80151 too)",
            f"{_PT}/issues/77284"),
    _mutant("saved_inputs_kept", "saved segment inputs stay referenced from a list nobody "
                                 "clears: they outlive backward, step after step",
            f"{_PT}/issues/84413"),
    _mutant("large_boundary_compressed", "boundary inputs above 64K elements stored in "
                                         "bfloat16 to save memory and cast back for the "
                                         "recompute: a size-gated lossy path",
            "https://github.com/inclusionAI/AReno/pull/538"),
    _mutant("group_layers_unchained", "a segment of several layers runs each of them on the "
                                      "segment's input instead of the previous layer's output",
            f"{_MEGATRON}/pull/290"),
    _mutant("bn_stats_in_recompute_only", "BatchNorm statistics frozen in the forward and left "
                                          "to the recompute: a forward without backward "
                                          "(no_grad, validation) never updates them",
            f"{_FAIRSCALE}/issues/1035"),
    _mutant("grads_without_graph", "a checkpoint that claims double backward while its "
                                   "backward takes the segment's gradients on detached inputs "
                                   "without create_graph, as reentrant checkpoints do: right "
                                   "for loss.backward(), but a gradient penalty's second-order "
                                   "terms through the segment are lost, silently",
            f"{_PT}/issues/33999", supports=("create-graph",)),
    _mutant("autocast_latched", "the autocast state latched in one process-wide slot that each "
                                "segment's forward overwrites, read back by every recompute: "
                                "right while all segments run under one autocast state, wrong "
                                "once precision is chosen per layer (a layer under "
                                "autocast(enabled=False))", "https://github.com/NVIDIA/"
                                                           "TransformerEngine/pull/3284"),
    _mutant("stash_kept_after_warmup", "a checkpoint whose first step runs a warm-up path and "
                                       "whose later steps stash the saved boundary tensors in "
                                       "a buffer that backward never clears: nothing leaks at "
                                       "step 1, and every later step leaves its stash behind",
            f"{_DEEPSPEED}/pull/1698"),
    _mutant("grad_mode_forced_on", "a checkpoint that makes its output require grad whatever "
                                   "the caller's grad mode: a frozen layer run under no_grad "
                                   "builds a graph, and its weights and everything before it "
                                   "get gradients they must not have (fairscale PR 787 too)",
            "https://github.com/OpenBMB/BMTrain/pull/8"),
    _mutant("nested_tensors_no_grad", "only top-level tensor arguments become inputs of the "
                                      "checkpoint's Function: tensors in a list, a tuple or a "
                                      "dict (HF's position_embeddings=(cos, sin), a pipeline's "
                                      "list of hidden states) are read as they are and get no "
                                      "gradient", f"{_PT}/pull/178568"),
    _mutant("rng_devices_from_positional", "the RNG states saved and restored are those of the "
                                           "devices of the top-level positional tensors: a "
                                           "segment whose tensors all come nested or by "
                                           "keyword recomputes with fresh dropout masks",
            f"{_PT}/pull/14518"),
    _mutant("autocast_device_from_first_arg", "the autocast state read for the device of the "
                                              "first positional argument, 'cuda' when that is "
                                              "no tensor: a CPU autocast forward whose first "
                                              "argument is a container recomputes in fp32",
            f"{_PT}/pull/128671"),
    _mutant("matmul_outputs_cached", "a policy that keeps matmul outputs by reference and "
                                     "hands them back to the recompute: an in-place op on one "
                                     "in the forward (scores scaled and masked in place, an "
                                     "in-place dropout after a projection) is applied to it "
                                     "again", f"{_PT}/issues/113737"),
    _mutant("hooks_skipped_in_recompute", "the recompute calls the segment's forward directly: "
                                          "its forward hooks and pre-hooks (a LoRA or steering "
                                          "hook, an input rescale) run in the forward and not "
                                          "in the recompute", "https://github.com/huggingface/"
                                                              "peft/issues/2826"),
    _mutant("hooks_run_twice", "a wrapper that applies the segment's forward hooks itself "
                               "around a call that already ran them: a steering vector is "
                               "added twice", f"{_PT}/pull/134310"),
    _mutant("outside_params_no_grad", "only the segment module's own parameters are inputs of "
                                      "the checkpoint's Function: a projection the parent "
                                      "holds, a gate the model owns, a weight in a closure "
                                      "get no gradient", f"{_PT}/issues/11944"),
    _mutant("outside_params_grad_doubled", "parameters the segment reads but does not own get "
                                           "their gradient twice: returned by the Function "
                                           "and accumulated into .grad by an inner backward "
                                           "(a shared weight's hook fires twice)",
            f"{_PT}/issues/81296"),
    _mutant("recomputed_held_to_backward_end", "each recompute's saved activations stay "
                                               "referenced until the whole backward ends (a "
                                               "reference cycle between a Function's context "
                                               "and its graph, freed by the collector or by "
                                               "an outer boundary): nothing is left after "
                                               "backward, yet backward's peak is full "
                                               "storage's",
            "https://github.com/radixark/miles/pull/2862"),
    _mutant("autocast_off_not_restored", "the recompute enters the forward's autocast where "
                                         "it had one and leaves the ambient state alone "
                                         "where it had none: a backward run inside an "
                                         "autocast block (an fp32 forward, an fp32 layer of "
                                         "a bf16 model) re-runs in bf16"),
    _mutant("boundary_per_module_slot", "the segment's inputs saved on its module (one slot, "
                                        "the last forward's): right while each forward is "
                                        "followed by its backward, wrong once micro-batches "
                                        "are in flight (GPipe, 1F1B, a summed backward)"),
    _mutant("state_per_module_stack", "RNG and autocast states pushed on a per-module stack "
                                      "by each forward and popped by each backward: right "
                                      "when backwards run in reverse order, wrong under "
                                      "GPipe's and 1F1B's first-in first-out backwards"),
    _mutant("host_pool_of_three", "saved inputs copied into a fixed set of three host "
                                  "buffers per layer, indexed by the calls still awaiting "
                                  "their backward (contiguous activation buffers indexed by "
                                  "layer, reset in backward): a fourth micro-batch in flight "
                                  "overwrites the first's", f"{_DEEPSPEED}/pull/3005"),
    _mutant("input_leaves_grad_kept", "detached input leaves made once in forward and reused "
                                      "by every backward pass, their .grad read back and never "
                                      "cleared: a second backward pass over the same forward "
                                      "(retain_graph) adds the first pass's input gradient",
            f"{_MEGATRON}/pull/6339"),
    _mutant("rng_state_consumed_by_backward", "the forward's RNG state handed to the first "
                                              "backward pass and dropped (popped from its "
                                              "stash): a second pass over the same forward "
                                              "re-runs dropout with fresh masks"),
    _mutant("saved_inputs_freed_after_backward", "saved inputs released by the first backward "
                                                 "pass (an offload buffer given back): a second "
                                                 "pass over the same forward (retain_graph) "
                                                 "returns no gradient, silently (Megatron's "
                                                 "CheckpointWithoutOutput sets its saved "
                                                 "tensors to None in backward)",
            "https://github.com/linkedin/Liger-Kernel/issues/555"),
    _mutant("trainable_params_cached", "the segment's trainable parameters cached at its first "
                                       "call: parameters unfrozen later (a layer frozen for "
                                       "the first steps, then trained) get no gradient",
            "https://github.com/modelscope/ms-swift/pull/10142"),
    _mutant("trainable_cached_per_process", "whether a segment has trainable parameters cached "
                                            "once for the process by its first call, shared "
                                            "by every layer: a process whose first call is a "
                                            "frozen layer runs every later layer under "
                                            "no_grad",
            "https://github.com/modelscope/ms-swift/pull/10142"),
    _mutant("frozen_segment_no_grad", "a segment whose parameters are all frozen run under "
                                      "no_grad, as having nothing to train: the gradient to "
                                      "its input, and so to every layer before it, is lost",
            "https://github.com/huggingface/transformers/issues/16276"),
    _mutant("none_outputs_dropped", "a checkpoint that repacks the segment's outputs from the "
                                    "values it hands through its Function and keeps those "
                                    "that are not None, as ModelOutput.to_tuple() does: a "
                                    "dict loses its None fields, (x, None, aux) comes back "
                                    "(x, aux) and the model reads the aux loss as attention "
                                    "weights, a dataclass or named tuple comes back a plain "
                                    "tuple", f"{_FAIRSCALE}/issues/802"),
)


def reference_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The correct base: every fault switched off."""
    return checkpoint_with_faults(function, *args, faults=Faults(), **kwargs)


#: The autocast state of the last segment forward, for the autocast-latched fault: one slot
#: for the process (device type, enabled, dtype), holding no tensor.
_LATCHED: list[tuple[str, bool, torch.dtype]] = []


#: Segments recomputed at least once, for the first-call faults; dies with the model.
_RECOMPUTED: weakref.WeakSet[Any] = weakref.WeakSet()

#: The first step's saved inputs per segment, for the stale-recompute fault; dies with the model.
_STALE: weakref.WeakKeyDictionary[Any, tuple[Tensor, ...]] = weakref.WeakKeyDictionary()

#: Per-segment state for the faults that key it by module instead of by call; each dies
#: with the model: the last forward's state (one slot), the states of forwards not yet
#: backpropagated (a queue), the last recompute's outputs, every step's saved inputs.
_SLOT: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
_QUEUE: weakref.WeakKeyDictionary[Any, deque[_State]] = weakref.WeakKeyDictionary()
_KEPT_OUTPUTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_KEPT_INPUTS: weakref.WeakKeyDictionary[Any, list[tuple[Tensor, ...]]] = (
    weakref.WeakKeyDictionary())

#: The faults that key by module what belongs to one call, each dying with the model: the
#: last forward's saved inputs (cleared when that call's context is freed), a stack of
#: states, three host buffers per segment and the calls awaiting backward that index them,
#: the trainable parameters of a segment's first call.
_BOUNDARY: weakref.WeakKeyDictionary[Any, tuple[Tensor, ...]] = weakref.WeakKeyDictionary()
_STACK: weakref.WeakKeyDictionary[Any, list[_State]] = weakref.WeakKeyDictionary()
_POOL: weakref.WeakKeyDictionary[Any, list[list[Tensor] | None]] = weakref.WeakKeyDictionary()
_AWAITING: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
_TRAINABLE: weakref.WeakKeyDictionary[Any, list[nn.Parameter]] = weakref.WeakKeyDictionary()
#: whether segments have trainable parameters, as the process's first call found
#: (trainable-cached-per-process)
_PROCESS_TRAINABLE: list[bool] = []

#: Host buffers per segment (host-pool-of-three).
_POOL_SIZE = 3

#: Inputs with more elements than this are stored compressed (large-boundary-compressed).
_COMPRESS_ABOVE = 65536


def checkpoint_with_faults(
    function: Callable[..., Any], *args: Any, faults: Faults, **kwargs: Any
) -> Any:
    """Recompute ``function`` in backward, with the given ``faults``."""
    if faults.no_op:
        return function(*args, **kwargs)
    if faults.inputs_detached:
        args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    if faults.kwarg_tensors_detached:
        kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    module = function if isinstance(function, nn.Module) else None
    params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
    if faults.trainable_cached_per_process and module is not None:
        if not _PROCESS_TRAINABLE:
            _PROCESS_TRAINABLE.append(bool(params))
        if not _PROCESS_TRAINABLE[0]:
            with torch.no_grad():
                return function(*args, **kwargs)
    if faults.frozen_segment_no_grad and module is not None and not params:
        with torch.no_grad():
            return function(*args, **kwargs)
    if faults.trainable_params_cached and module is not None:
        params = _TRAINABLE.setdefault(module, params)
    leaves, spec = tree_flatten((args, kwargs))
    top = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, Tensor)}
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)
             and (id(leaf) in top or not faults.nested_tensors_no_grad)]
    run = _Run(function, leaves, spec, slots, args, faults, module, params=params)
    tensors = [leaves[i] for i in slots]
    outside = _first_run(run, tensors, params)
    run.n_params = len(params) + len(outside)
    # The Function hands over a flat tuple (its outputs are tensors or other values, never a
    # structure): the structure comes back around it.
    flat, structure = tree_flatten(run.out)
    run.out = tuple(flat)
    grad_mode = torch.enable_grad() if faults.grad_mode_forced_on else contextlib.nullcontext()
    with grad_mode:
        handed = _Recompute.apply(run, *tensors, *params, *outside)  # type: ignore[no-untyped-call]  # untyped
    out = tree_unflatten(list(handed), structure)
    if faults.none_outputs_dropped:
        out = _without_nones(out)
    if faults.padding_zeroed:
        mask = next((a for a in [*args, *kwargs.values()] if isinstance(a, Tensor)
                     and a.dtype == torch.bool and a.dim() == 2), None)
        if mask is not None and isinstance(out, Tensor) and out.shape[:2] == mask.shape:
            out = out * mask[..., None].to(out.dtype)
    return out


def _without_nones(out: Any) -> Any:
    """``out`` repacked from its values that are not None (the none-outputs-dropped fault)."""
    if isinstance(out, dict):
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(out, tuple):
        return tuple(v for v in out if v is not None)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        values = (getattr(out, f.name) for f in dataclasses.fields(out))
        return tuple(v for v in values if v is not None)
    return out


def _first_run(run: _Run, tensors: list[Tensor], params: list[nn.Parameter]
               ) -> list[nn.Parameter]:
    """The segment's forward, under no_grad, before the Function is applied: its outputs go
    to ``run.out``, its RNG and autocast state to ``run.state``; the parameters it read that
    require grad and are neither its module's nor its inputs come back (they are inputs of
    the Function too)."""
    faults = run.faults
    device_type = tensors[0].device.type if tensors else "cpu"
    if not faults.rng_captured_late:
        run.capture(device_type)
    module = run.module
    frozen = [b.clone() for b in module.buffers()] \
        if module is not None and faults.bn_stats_in_recompute_only else []
    own = module.parameters() if module is not None else ()
    known = {id(t) for t in (*tensors, *params, *own)}
    reads = _OutsideReads(known) if not faults.outside_params_no_grad \
        else contextlib.nullcontext(None)
    cache = MatmulStore(run.cached, replay=False) if faults.matmul_outputs_cached \
        else contextlib.nullcontext()
    with torch.no_grad(), reads as seen, cache:
        run.out = run.call(tuple(tensors), recompute=False)
    if frozen and module is not None:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), frozen):
                buffer.copy_(value)
    if faults.rng_captured_late:
        run.capture(device_type)
    state = run.state
    assert state is not None
    if faults.autocast_latched:
        _LATCHED[:] = [state.autocast]
    if faults.state_per_module_slot:
        _SLOT[run.function] = state
    if faults.state_queue_without_backward:
        _QUEUE.setdefault(run.function, deque()).append(state)
    if faults.state_per_module_stack:
        _STACK.setdefault(run.function, []).append(state)
    outside = list(seen.found.values()) if seen is not None else []
    run.outside = outside
    return outside


class _OutsideReads(TorchFunctionMode):
    """The parameters requiring grad that torch functions read, but for those ``known``."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.found: dict[int, nn.Parameter] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for arg in (*args, *kwargs.values()):
            for item in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(item, nn.Parameter) and item.requires_grad \
                        and id(item) not in self.known:
                    self.found.setdefault(id(item), item)
        return func(*args, **kwargs)


#: The matmul ops whose outputs the matmul-outputs-cached fault keeps.
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default)


# torch leaves TorchDispatchMode untyped (__init_subclass__, __init__).
class MatmulStore(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A selective store of matmul outputs: the forward keeps each one, the recompute hands
    them back in order instead of computing them. Kept by reference (``copy=False``, as a
    policy that saves matmul outputs keeps them) it is the matmul-outputs-cached fault:
    right while nothing writes to them, but an in-place op on one (a scale, a mask, an
    in-place dropout) is then applied to it a second time. Kept as copies it is right."""

    def __init__(self, store: list[Tensor], *, replay: bool, copy: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.store, self.replay, self.copy = store, replay, copy

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _MATMULS and self.replay and self.store:
            return self.store.pop(0)
        out = func(*args, **(kwargs or {}))
        if func in _MATMULS and not self.replay:
            self.store.append(out.clone() if self.copy else out)
        return out


@dataclass
class _State:
    """What the first run had and the recompute must have again."""

    cpu_rng: Tensor | None  # None: not saved (rng-devices-from-positional without a CPU arg)
    cuda_rng: list[Tensor | None] | None
    autocast: tuple[str, bool, torch.dtype]  # device type, enabled, dtype


@dataclass
class _Run:
    function: Callable[..., Any]
    leaves: list[Any]  # the arguments ``(args, kwargs)`` flattened
    spec: Any  # their tree structure
    slots: list[int]  # the leaves that are Function inputs (tensors)
    positional: tuple[Any, ...]  # the top-level positional arguments, as given
    faults: Faults
    module: nn.Module | None
    n_params: int = 0  # parameters among the Function inputs: own, then outside
    params: list[nn.Parameter] = field(default_factory=list)  # own, as the call found them
    state: _State | None = None
    out: Any = None  # the first run's outputs, until the Function hands them over
    outside: list[nn.Parameter] = field(default_factory=list)
    cached: list[Tensor] = field(default_factory=list)  # matmul-outputs-cached

    def capture(self, device_type: str) -> _State:
        """RNG and autocast state now; autocast off is kept as off, on ``device_type``."""
        faults = self.faults
        cuda_rng: list[Tensor | None] | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            cuda_rng = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())]
        cpu_rng: Tensor | None = torch.get_rng_state()
        if faults.rng_devices_from_positional:
            devices = {a.device for a in self.positional if isinstance(a, Tensor)}
            cpu_rng = cpu_rng if any(d.type == "cpu" for d in devices) else None
            cuda_rng = [s if torch.device("cuda", d) in devices else None
                        for d, s in enumerate(cuda_rng)] if cuda_rng else None
        autocast = (device_type, False, torch.get_autocast_dtype(device_type))
        if faults.autocast_device_from_first_arg:
            first = self.positional[0] if self.positional else None
            kind = first.device.type if isinstance(first, Tensor) else "cuda"
            autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        else:
            for kind in ("cuda", "cpu"):
                if torch.is_autocast_enabled(kind):
                    autocast = (kind, True, torch.get_autocast_dtype(kind))
                    break
        self.state = _State(cpu_rng, cuda_rng, autocast)
        return self.state

    def call(self, tensors: tuple[Tensor, ...], recompute: bool,
             swap: dict[str, Tensor] | None = None) -> Any:
        """The segment on ``tensors`` (the Function's tensor inputs, in their places among
        the arguments); ``swap``: parameters and buffers of the segment module replaced for
        the call, by name."""
        leaves = list(self.leaves)
        for i, tensor in zip(self.slots, tensors):
            leaves[i] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        args = tuple(args)
        if self.faults.kwargs_dropped and recompute:
            kwargs = {}
        blocks = getattr(self.function, "blocks", None)
        if self.faults.group_layers_unchained and isinstance(blocks, nn.ModuleList) \
                and len(blocks) > 1:
            return _unchained(blocks, args, kwargs)
        if swap is not None and isinstance(self.function, nn.Module):
            return torch.func.functional_call(self.function, swap, args, kwargs)
        if self.faults.hooks_skipped_in_recompute and recompute \
                and isinstance(self.function, nn.Module):
            return self.function.forward(*args, **kwargs)
        out = self.function(*args, **kwargs)
        if self.faults.hooks_run_twice and isinstance(self.function, nn.Module):
            for hook in self.function._forward_hooks.values():
                changed = hook(self.function, args, out)
                out = out if changed is None else changed
        return out


def _unchained(blocks: nn.ModuleList, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A group's custom forward that feeds each layer the group's input (the fault)."""
    from gradequiv.models.transformer import pack_outputs, unpack_outputs

    kind = getattr(blocks[-1], "outputs", "plain")
    outs = [unpack_outputs(kind, block(*args, **kwargs)) for block in blocks]
    auxes = [aux for _, aux in outs if aux is not None]
    return pack_outputs(kind, outs[-1][0], sum(auxes[1:], auxes[0]) if auxes else None)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _Run, *inputs: Tensor) -> Any:
        """Hands over the first run's outputs (``_first_run``) and saves the tensor inputs."""
        faults = run.faults
        tensors = inputs[:len(inputs) - run.n_params]
        ctx.run = run
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        out, run.out = run.out, None
        if faults.large_boundary_compressed:
            ctx.dtypes = [t.dtype for t in tensors]
            ctx.needs = [t.requires_grad for t in tensors]
            tensors = tuple(t.to(torch.bfloat16) if t.is_floating_point()
                            and t.numel() > _COMPRESS_ABOVE else t for t in tensors)
        if faults.saved_inputs_kept or (faults.stash_kept_after_warmup
                                        and run.function in _RECOMPUTED):
            _KEPT_INPUTS.setdefault(run.function, []).append(tuple(tensors))
        if faults.boundary_per_module_slot:
            _BOUNDARY[run.function] = tuple(tensors)
            weakref.finalize(ctx, _forget_boundary, run.function, _BOUNDARY[run.function])
        if faults.input_leaves_grad_kept:
            ctx.leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
        if faults.host_pool_of_three:
            ctx.needs = [t.requires_grad for t in tensors]
            ctx.pooled = _into_pool(run.function, ctx, tensors)
            tensors = ()
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        run: _Run = ctx.run
        faults = run.faults
        if faults.crash_in_backward:
            raise RuntimeError("recompute buffer was freed before backward")
        if faults.saved_inputs_freed_after_backward:
            if getattr(ctx, "freed", False):
                return (None,) * len(ctx.needs_input_grad)
            ctx.freed = True
        saved = ctx.saved_tensors
        if faults.boundary_per_module_slot:
            saved = _BOUNDARY.get(run.function, saved)
        if faults.host_pool_of_three:
            _AWAITING[run.function].discard(ctx)
            saved = tuple(t.detach().requires_grad_(needs)
                          for t, needs in zip(ctx.pooled, ctx.needs))
        if faults.large_boundary_compressed:
            saved = tuple(t.to(dtype).requires_grad_(needs)
                          for t, dtype, needs in zip(saved, ctx.dtypes, ctx.needs))
        if faults.stale_recompute:
            saved = _STALE.setdefault(
                run.function, tuple(t.detach().requires_grad_(t.requires_grad) for t in saved))
        # Under create_graph the engine runs backward with grad mode on, and the gradients
        # must stay differentiable in the inputs, the parameters and the incoming gradients.
        # The recompute then runs on an alias (a view: a node of its own) of each input and
        # of each parameter, and on copies of the buffers (nothing to put back, no saved
        # buffer bumped): the gradient taken for an alias is its own, never summed over paths
        # through another input (x0 reaches x through the layers before; a layer applied
        # twice reaches its parameters through its first application), while the graph of
        # that gradient leads back to the original. Otherwise: detached copies.
        double = torch.is_grad_enabled() and not (
            faults.grads_without_graph or faults.grad_via_backward
            or faults.accumulated_grad_overwritten)
        inputs = tuple(t.view_as(t) if double and t.requires_grad
                       else t.detach().requires_grad_(t.requires_grad) for t in saved)
        if faults.input_leaves_grad_kept:
            inputs = ctx.leaves
        module = run.module
        # The parameters that were Function inputs: those that trained when the call ran
        chosen = {id(p) for p in run.params}
        named = [(n, p) for n, p in module.named_parameters() if id(p) in chosen] \
            if module is not None else []
        # Then the parameters it read and does not own: read through the closure or the
        # module that holds them, so never aliased (the base claims no create-graph).
        params = [p for _, p in named] + run.outside
        swap: dict[str, Tensor] | None = None
        if double and module is not None:
            swap = {n: p.view_as(p) for n, p in named}
            swap |= {n: b.clone() for n, b in module.named_buffers()}
        wrt = [*(swap[n] for n, _ in named), *run.outside] if swap is not None else params
        buffers = [b.clone() for b in module.buffers()] \
            if module is not None and swap is None else []
        first = run.function not in _RECOMPUTED
        _RECOMPUTED.add(run.function)
        state = run.state
        if faults.state_per_module_slot:
            state = _SLOT.get(run.function, state)
        if faults.state_queue_without_backward and _QUEUE.get(run.function):
            state = _QUEUE[run.function].popleft()
        if faults.state_per_module_stack and _STACK.get(run.function):
            state = _STACK[run.function].pop()
        assert state is not None
        if faults.rng_state_consumed_by_backward:  # what a later pass finds: no RNG state
            run.state = _State(None, None, state.autocast)
        cache = MatmulStore(run.cached, replay=True) if faults.matmul_outputs_cached \
            else contextlib.nullcontext()
        kept = _held_to_backward_end() if faults.recomputed_held_to_backward_end \
            else contextlib.nullcontext()
        with _recompute_state(run, state, first), torch.enable_grad(), cache, kept:
            out = run.call(inputs, recompute=True, swap=swap)
        run.cached.clear()
        if faults.recomputed_kept:
            _KEPT_OUTPUTS[run.function] = out
        outs = tree_flatten(out)[0]
        if faults.gradient_skew:
            grads = tuple(None if g is None else g * (1 + 1e-4) for g in grads)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if faults.tuple_tail_no_grad:
            pairs = pairs[:1]
        wanted = [t for t in inputs if t.requires_grad]
        if faults.grad_via_backward or faults.accumulated_grad_overwritten:
            input_grads, param_grads = _grads_via_backward(pairs, inputs, params, faults)
        else:
            got: list[Tensor | None] = [None] * (len(wanted) + len(params))
            if pairs and got:
                got = list(torch.autograd.grad([o for o, _ in pairs], wanted + wrt,
                                               [g for _, g in pairs], allow_unused=True,
                                               create_graph=double))
            if faults.input_leaves_grad_kept:
                _accumulate_into_leaves(wanted, got[:len(wanted)])
                got[:len(wanted)] = [t.grad for t in wanted]
            it = iter(got[:len(wanted)])
            input_grads = [next(it) if t.requires_grad else None for t in inputs]
            param_grads = got[len(wanted):]
        if module is not None and not (faults.buffers_updated_twice
                                       or faults.bn_stats_in_recompute_only):
            # Only now: BatchNorm's backward reads the running statistics it saved.
            with torch.no_grad():
                for buffer, value in zip(module.buffers(), buffers):
                    buffer.copy_(value)
        if faults.input_grads_dropped:
            input_grads = input_grads[:1] + [None] * (len(input_grads) - 1)
        if faults.outside_params_grad_doubled:  # an inner backward's .grad kept as well
            with torch.no_grad():
                for p, g in zip(run.outside, param_grads[len(named):]):
                    if g is not None:
                        p.grad = g.detach().clone() if p.grad is None else p.grad + g
        return (None, *input_grads, *param_grads)


def _forget_boundary(function: Any, tensors: tuple[Tensor, ...]) -> None:
    """A freed call's inputs leave the module's slot, unless a later call's are there."""
    if _BOUNDARY.get(function) is tensors:
        del _BOUNDARY[function]


def _into_pool(function: Any, ctx: Any, tensors: tuple[Tensor, ...]) -> list[Tensor]:
    """Copies of ``tensors`` in the segment's host buffer numbered by how many of its calls
    (their contexts) await their backward (host-pool-of-three): a fourth in flight reuses
    the first's."""
    awaiting = _AWAITING.setdefault(function, weakref.WeakSet())
    pool = _POOL.setdefault(function, [None] * _POOL_SIZE)
    index = len(awaiting) % _POOL_SIZE
    awaiting.add(ctx)
    buffers = pool[index]
    if buffers is None or [(b.shape, b.dtype) for b in buffers] != [
            (t.shape, t.dtype) for t in tensors]:
        buffers = pool[index] = [t.detach().clone() for t in tensors]
    else:
        with torch.no_grad():
            for buffer, t in zip(buffers, tensors):
                buffer.copy_(t)
    return buffers


def _accumulate_into_leaves(leaves: list[Tensor], grads: list[Tensor | None]) -> None:
    """What ``torch.autograd.backward(outputs, inputs=leaves)`` does: each gradient added
    into its leaf's ``.grad`` (input-leaves-grad-kept then reads ``.grad`` back)."""
    with torch.no_grad():
        for leaf, g in zip(leaves, grads):
            if g is not None:
                leaf.grad = g.detach().clone() if leaf.grad is None else leaf.grad + g


def _held_to_backward_end() -> Any:
    """Saved-tensor hooks that keep everything the recompute saves in a list the engine
    clears when the whole backward has run (the recomputed-held-to-backward-end fault)."""
    held: list[Tensor] = []
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(held.clear)

    def pack(t: Tensor) -> Tensor:
        held.append(t)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpacked)


def _unpacked(t: Tensor) -> Tensor:
    return t


def _grads_via_backward(
    pairs: list[tuple[Tensor, Tensor]], inputs: tuple[Tensor, ...], params: list[nn.Parameter],
    faults: Faults,
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """The old reentrant way: an inner ``torch.autograd.backward`` that accumulates into the
    parameters' ``.grad`` (grad-via-backward: returns no parameter gradient, as they are
    already there), or clears ``.grad`` first to read this call's gradient back and return it
    (accumulated-grad-overwritten: what earlier micro-batches left there is lost)."""
    if faults.accumulated_grad_overwritten:
        for p in params:
            p.grad = None
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    input_grads = [t.grad if t.requires_grad else None for t in inputs]
    if not faults.accumulated_grad_overwritten:
        return input_grads, [None] * len(params)
    param_grads = [p.grad for p in params]
    for p in params:  # handed to autograd instead, so it is not counted twice
        p.grad = None
    return input_grads, param_grads


@contextlib.contextmanager
def _recompute_state(run: _Run, state: _State, first: bool) -> Iterator[None]:
    """RNG, autocast and train mode as the first run had them (unless a fault says)."""
    faults, module = run.faults, run.module
    moved = faults.caller_stream_moved or (faults.caller_stream_moved_once and first)
    fork = contextlib.nullcontext() if moved else torch.random.fork_rng(
        devices=list(range(torch.cuda.device_count())) if state.cuda_rng else [])
    with fork:
        if faults.reseeded:
            torch.manual_seed(0)
        elif not (faults.no_rng_restore or (faults.rng_lost_on_first_call and first)):
            if state.cpu_rng is not None:
                torch.set_rng_state(state.cpu_rng)
            if state.cuda_rng and not faults.cuda_rng_not_restored:
                for device, cuda_state in enumerate(state.cuda_rng):
                    if cuda_state is not None:
                        torch.cuda.set_rng_state(cuda_state, device)
        device_type, enabled, dtype = _LATCHED[0] if faults.autocast_latched else state.autocast
        if faults.autocast_forced_on:
            enabled = state.autocast is not None  # the truthiness bug: any saved state is "on"
        if faults.autocast_lost:
            enabled = False
        autocast: Any = contextlib.ExitStack()
        if enabled and faults.autocast_default_dtype:
            autocast = torch.autocast(device_type, enabled=True)
        elif enabled:
            autocast = torch.autocast(device_type, dtype=dtype, enabled=True)
        elif not faults.autocast_off_not_restored:
            # Off is a state too: a backward run inside an autocast block must not re-run
            # a segment whose forward ran without autocast under backward's
            for kind in _AUTOCAST_DEVICES:
                if torch.is_autocast_enabled(kind):
                    autocast.enter_context(torch.autocast(kind, enabled=False))
        kernel: Any = (sdpa_kernel(SDPBackend.MATH) if faults.rerun_other_attention_kernel
                       else contextlib.nullcontext())
        was_training = module.training if module is not None else None
        if module is not None and faults.dropout_off:
            module.eval()
        try:
            with autocast, kernel:
                yield
        finally:
            if module is not None and was_training is not None:
                module.train(was_training)


#: The device types whose autocast a recompute turns off where the forward ran without it.
_AUTOCAST_DEVICES = ("cpu", "cuda")


def switches() -> list[str]:
    """Every fault switch, for listings and checks that the registry covers them."""
    return [f.name for f in fields(Faults)]


# Each mutant as a module attribute, so a SPEC can name it:
# ``gradequiv check --impl gradequiv.harness.implementations.faults:no_rng_restore``.
for _mutant_entry in MUTANTS:
    globals()[_mutant_entry.name.replace("-", "_")] = _mutant_entry.impl
del _mutant_entry
