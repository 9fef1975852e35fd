"""A hand-written recompute, as many training codebases carry one.

``my_checkpoint`` restores the RNG state but forgets the autocast state:
``gradequiv check --impl hand_written:my_checkpoint`` passes every fp32 case
and fails the autocast ones (bf16 and fp16). ``my_checkpoint_fixed`` re-enters
autocast. Both pass tensor keyword arguments to the autograd.Function as inputs
(a tensor bound in a closure would get no gradient of its own), and both call
backward inside backward, as torch's reentrant checkpoint does, so neither can
run under ``torch.autograd.grad``: they say so, and those cases are not drawn.
"""

import torch


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
    """Tensor keyword arguments go in after ``args``, as inputs of the Function."""
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    n = len(args)

    def run(*inputs):
        return function(*inputs[:n], **rest, **dict(zip(names, inputs[n:])))

    return _Recompute.apply(run, autocast, *args, *(kwargs[k] for k in names))


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
