"""A hand-written recompute, as many training codebases carry one.

``my_checkpoint`` restores the RNG state but forgets the autocast state:
``gradequiv check --impl hand_written:my_checkpoint`` passes every fp32 case
and fails the autocast ones (bf16 and fp16). ``my_checkpoint_fixed`` re-enters
autocast. Both pass every tensor of their arguments, by keyword or nested in
containers, to the autograd.Function as inputs (a tensor bound in a closure
would get no gradient of its own), hand back what the segment returns (a dict or a
tuple with None fields) around the Function's tensor outputs, and both call
backward inside backward, as torch's reentrant checkpoint does, so neither can
run under ``torch.autograd.grad``: they say so, and those cases are not drawn.
"""

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, autocast, *args):
        ctx.function, ctx.autocast, ctx.rng = function, autocast, torch.get_rng_state()
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):  # one per output: a layer may return a tuple
        inputs = [x if x is None else x.detach().requires_grad_(x.requires_grad)
                  for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), ctx.autocast:
            torch.set_rng_state(ctx.rng)
            output = ctx.function(*inputs)
        torch.autograd.backward(output if isinstance(output, tuple) else (output,), grads)
        return (None, None, *(x if x is None else x.grad for x in inputs))


def _apply(function, autocast, args, kwargs):
    """Every tensor of the arguments, by keyword or nested in lists, tuples and dicts, goes in
    as an input of the Function: one left in a closure or a container gets no gradient.
    Every tensor the segment returns comes out of it, and what held them (a dict, a
    dataclass, a tuple with None in it) is rebuilt around them: a Function hands back
    tensors and tuples only."""
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    returned = []

    def run(*tensors):
        filled = list(leaves)
        for i, t in zip(where, tensors):
            filled[i] = t
        call_args, call_kwargs = tree_unflatten(filled, spec)
        returned[:] = tree_flatten(function(*call_args, **call_kwargs))
        return tuple(x for x in returned[0] if isinstance(x, torch.Tensor))

    tensors = iter(_Recompute.apply(run, autocast, *(leaves[i] for i in where)))
    out, structure = returned
    return tree_unflatten([next(tensors) if isinstance(x, torch.Tensor) else x for x in out],
                          structure)


def my_checkpoint(function, *args, **kwargs):
    no_autocast = torch.autocast("cpu", enabled=False)  # the bug
    return _apply(function, no_autocast, args, kwargs)


def my_checkpoint_fixed(function, *args, **kwargs):
    dtype = torch.get_autocast_dtype("cpu")
    autocast = torch.autocast("cpu", dtype=dtype, enabled=torch.is_autocast_enabled("cpu"))
    return _apply(function, autocast, args, kwargs)


# Backward inside backward writes .grad, which torch.autograd.grad must not see touched.
my_checkpoint.gradequiv_unsupported = ("autograd-grad",)
my_checkpoint_fixed.gradequiv_unsupported = ("autograd-grad",)
