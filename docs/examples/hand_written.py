"""A hand-written recompute, as many training codebases carry one.

``my_checkpoint`` restores the RNG state but forgets the autocast state:
``gradequiv check --impl hand_written:my_checkpoint`` passes every fp32 case
and fails the bf16-autocast ones. ``my_checkpoint_fixed`` re-enters autocast.
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
    def backward(ctx, grad):
        inputs = [x if x is None else x.detach().requires_grad_(x.requires_grad)
                  for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), ctx.autocast:
            torch.set_rng_state(ctx.rng)
            output = ctx.function(*inputs)
        torch.autograd.backward(output, grad)
        return (None, None, *(x if x is None else x.grad for x in inputs))


def my_checkpoint(function, *args, **kwargs):
    no_autocast = torch.autocast("cpu", enabled=False)
    return _Recompute.apply(lambda *a: function(*a, **kwargs), no_autocast, *args)


def my_checkpoint_fixed(function, *args, **kwargs):
    dtype = torch.get_autocast_dtype("cpu")
    autocast = torch.autocast("cpu", dtype=dtype, enabled=torch.is_autocast_enabled("cpu"))
    return _Recompute.apply(lambda *a: function(*a, **kwargs), autocast, *args)
