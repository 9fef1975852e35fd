"""Implementations written for the tests: deliberately wrong ones, and a few right ones.

Each wrong one breaks exactly one thing, so a test can say which property
must catch it. Referenced by SPEC (``wrong_impls:NAME``) from the CLI tests;
pytest puts this folder on sys.path.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import Counter
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint


def _checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward (a bitwise copy); backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError("recompute buffer was freed before backward")


def scaled_output(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Outputs off by 1e-3 (and so everything downstream)."""
    return _checkpoint(fn, *args, **kwargs) * (1 + 1e-3)


def skewed_gradients(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Forward exact, every gradient through the segment off by a relative 1e-4."""
    return _ScaleGrad.apply(_checkpoint(fn, *args, **kwargs), 1 + 1e-4)


def nan_gradients(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Forward exact, gradients NaN."""
    return _ScaleGrad.apply(_checkpoint(fn, *args, **kwargs), float("nan"))


def moves_caller_rng(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Recompute right, but backward draws from the caller's stream and leaves it moved."""
    out = _checkpoint(fn, *args, **kwargs)
    out.register_hook(lambda grad: (torch.rand(1), grad)[1])
    return out


_calls: Counter[int] = Counter()


def wrong_from_second_step(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Exact on each segment's first call; gradients skewed on every later call."""
    _calls[id(fn)] += 1
    out = _checkpoint(fn, *args, **kwargs)
    return out if _calls[id(fn)] == 1 else _ScaleGrad.apply(out, 1 + 1e-3)


def no_op(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Keeps every activation: gradients right, nothing recomputed, nothing saved."""
    return fn(*args, **kwargs)


def raises_in_backward(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Its first output tensor (the hidden state, beside an aux loss or in a dict) raises."""
    leaves, structure = tree_flatten(_checkpoint(fn, *args, **kwargs))
    first = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    leaves[first] = _RaiseInBackward.apply(leaves[first])
    return tree_unflatten(leaves, structure)


def returns_tuple(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The wrong structure: a tuple where the segment returns a tensor."""
    return (_checkpoint(fn, *args, **kwargs),)


def _kwargs_in_forward_only(fn: Any, kwargs: dict[str, Any]) -> Any:
    """``fn`` given ``kwargs`` on its first call (the forward), not on later ones."""
    first = itertools.count()

    def run(*a: Any) -> Any:
        return fn(*a, **kwargs) if next(first) == 0 else fn(*a)

    return run


def drops_kwargs(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Keyword arguments reach the first forward but not the recompute."""
    return _checkpoint(_kwargs_in_forward_only(fn, kwargs), *args)


def selective_drops_kwargs(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's selective checkpoint saving every matmul output (a store the re-run reads
    the forward's outputs from, unchanged), with keyword arguments dropped in the re-run."""
    from correct_impls import user_matmul_policy_checkpoint

    return user_matmul_policy_checkpoint(_kwargs_in_forward_only(fn, kwargs), *args)


def copying_store_no_rng_restore(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """correct_impls' copying matmul store, with the RNG state not restored."""
    from correct_impls import copying_matmul_store

    return copying_matmul_store(fn, *args, preserve_rng_state=False, **kwargs)


def autocast_lost_in_rerun(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's checkpoint with the re-run out of autocast: its check of the recomputed
    tensors raises in backward, with a message that ends in tips, not in the error."""
    first = itertools.count()

    def run(*a: Any, **k: Any) -> Any:
        if next(first) == 0:
            return fn(*a, **k)
        with torch.autocast("cpu", enabled=False):
            return fn(*a, **k)

    return _checkpoint(run, *args, **kwargs)


def interrupts(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands for a Ctrl-C in the middle of a run."""
    raise KeyboardInterrupt


def buffer_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A correct checkpoint for BatchNorm: the recompute puts the buffers back.

    The restore sits in ``finally`` because non-reentrant checkpoint stops a
    recompute early, by an exception, once it has what backward needs.
    """
    calls = itertools.count()

    def run(*a: Any, **k: Any) -> Any:
        if next(calls) == 0:
            return fn(*a, **k)
        saved = [b.clone() for b in fn.buffers()]
        try:
            return fn(*a, **k)
        finally:
            with torch.no_grad():
                for buffer, value in zip(fn.buffers(), saved):
                    buffer.copy_(value)

    return _checkpoint(run, *args, **kwargs)


class CheckpointWrapper(nn.Module):
    """A right ``wrapper`` implementation: ``impl(module) -> module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(self.inner, *args, **kwargs)


def toggle_on(model: nn.Module) -> None:
    """A right ``toggle`` implementation: the model turns recompute on itself."""
    model.gradient_checkpointing_enable()  # type: ignore[operator]


def toggle_forgotten(model: nn.Module) -> None:
    """A wrong toggle: says it enabled recompute, did nothing."""


_flaky_calls = itertools.count()


def wrong_only_at_first(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Nondeterministic in effect: skews gradients on its first two calls in the process only."""
    out = _checkpoint(fn, *args, **kwargs)
    return _ScaleGrad.apply(out, 1 + 1e-3) if next(_flaky_calls) < 2 else out


def sleepy(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Correct, but slow once the first property test is over (a run to interrupt)."""
    import os
    import time
    from pathlib import Path

    marker = os.environ.get("GRADEQUIV_TEST_SLEEP_AFTER")
    if marker and Path(marker).exists():
        time.sleep(0.5)
    return _checkpoint(fn, *args, **kwargs)


def hangs(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Never returns: a stand-in for a collective that never completes."""
    import time

    time.sleep(3600)
    return fn(*args, **kwargs)


def patches_forward_in_place(module: nn.Module) -> nn.Module:
    """Correct, wrapped the way fairscale's checkpoint_wrapper does it: the instance's
    ``forward`` replaced by a ``(*args, **kwargs)`` function."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    return module


def offload_that_recomputes(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Says it offloads, but checkpoints: the segment runs again in backward."""
    return _checkpoint(fn, *args, **kwargs)


offload_that_recomputes.gradequiv_strategy = "offload"  # type: ignore[attr-defined]


def offload_with_fresh_masks(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Offloads, then recomputes anyway without restoring the RNG: wrong gradients."""
    with torch.autograd.graph.save_on_cpu():
        return _checkpoint(fn, *args, preserve_rng_state=False, **kwargs)


offload_with_fresh_masks.gradequiv_strategy = "offload"  # type: ignore[attr-defined]


def exits_quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Ends the process with status 0 at its first call, as a stray ``os._exit(0)`` does."""
    os._exit(0)


_calls_until_interrupt = itertools.count()


def interrupts_later(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A correct checkpoint until its 40th call, then a Ctrl-C: several cases have finished."""
    if next(_calls_until_interrupt) == 40:
        raise KeyboardInterrupt
    return _checkpoint(fn, *args, **kwargs)


_calls_until_exit = itertools.count()


def exits_later(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A correct checkpoint until its 20th call, then ``os._exit(0)``: several cases have
    finished, and the process ends with the status of a pass (the named cases, each in a
    fresh process, do not count towards it: the drawn ones do)."""
    if next(_calls_until_exit) == 20:
        os._exit(0)
    return _checkpoint(fn, *args, **kwargs)


def killed_later(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A correct checkpoint until its 20th call, then SIGKILL of its own process (as the
    kernel's out-of-memory killer does)."""
    import signal

    if next(_calls_until_exit) == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    return _checkpoint(fn, *args, **kwargs)


def hangs_later(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A correct checkpoint until its 20th call, then it never returns (a deadlock)."""
    import time

    if next(_calls_until_exit) >= 20:
        time.sleep(3600)
    return _checkpoint(fn, *args, **kwargs)


def calls_sys_exit(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls ``sys.exit(3)`` in the segment, as a library's fatal-error path does."""
    import sys

    sys.exit(3)


def leaves_a_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Correct, but starts a non-daemon thread that never ends (a forgotten prefetcher): the
    process would hang at exit, after its verdict."""
    import threading
    import time

    if not any(t.name == "forgotten-prefetcher" for t in threading.enumerate()):
        threading.Thread(target=time.sleep, args=(3600,), name="forgotten-prefetcher",
                         daemon=False).start()
    return _checkpoint(fn, *args, **kwargs)


def wrapper_that_raises(module: nn.Module) -> nn.Module:
    """A ``wrapper`` that refuses the module it is given, as one written for another model
    class does."""
    raise TypeError(f"cannot wrap {type(module).__name__}: expected a LlamaDecoderLayer")


def toggle_that_raises(model: nn.Module) -> None:
    """A ``toggle`` that raises when applied (the model has no such switch)."""
    raise AttributeError("model has no attribute 'enable_recompute'")


def uses_a_torch_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Correct; its first call makes torch start a thread of its own (the prefetch pool
    behind inductor's caches, a non-daemon executor worker that outlives the run): torch's
    thread, not the implementation's."""
    from torch.utils import _functools

    if not getattr(uses_a_torch_thread, "started", False):
        uses_a_torch_thread.started = True  # type: ignore[attr-defined]
        _functools.prefetchable_cache(lambda: 1).prefetch()  # type: ignore[attr-defined]
    return _checkpoint(fn, *args, **kwargs)


def slow_to_exit(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Correct; the process takes seconds to end after the verdict (an atexit handler
    standing in for torch's teardown on a loaded machine)."""
    import atexit
    import time

    if not getattr(slow_to_exit, "registered", False):
        slow_to_exit.registered = True  # type: ignore[attr-defined]
        atexit.register(time.sleep, 4)
    return _checkpoint(fn, *args, **kwargs)


def leaves_a_process(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Correct, but starts a helper process at its first call and never stops it."""
    import subprocess
    import sys

    if not getattr(leaves_a_process, "started", False):
        leaves_a_process.started = True  # type: ignore[attr-defined]
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _checkpoint(fn, *args, **kwargs)


def _nudges_outputs(module: nn.Module, inputs: Any, output: Any) -> Any:
    return output * 1.001 if isinstance(output, Tensor) else None


def leaves_a_forward_hook(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Right gradients, but registers a global module forward hook (unless it is there) and
    never removes it: every later module call, of full storage's paths too, runs it."""
    from torch.nn.modules import module as nn_module

    if _nudges_outputs not in nn_module._global_forward_hooks.values():
        nn_module.register_module_forward_hook(_nudges_outputs)
    return _checkpoint(fn, *args, **kwargs)


def prints_and_fails(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Print-debugging in a wrong implementation (no RNG restore): what it prints must
    reach the user."""
    import sys

    print(f"debug: checkpointing {getattr(fn, '__qualname__', fn)}")
    print("debug: about to recompute", file=sys.stderr)
    return _checkpoint(fn, *args, preserve_rng_state=False, **kwargs)


def ignores_stop_signals(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Ignores SIGINT and SIGTERM, says it has (touches GRADEQUIV_TEST_MARKER), then works
    for ten minutes: a run asked to stop must stop it all the same."""
    import signal
    import time
    from pathlib import Path

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    marker = os.environ.get("GRADEQUIV_TEST_MARKER")
    if marker:
        Path(marker).touch()
    time.sleep(600)
    return _checkpoint(fn, *args, **kwargs)


def closes_its_streams(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Closes the process's standard output and error (file descriptors 1 and 2), as a
    daemonising library does, then checkpoints correctly."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.close(1)
    os.close(2)
    return _checkpoint(fn, *args, **kwargs)


def returns_none(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs the segment and forgets to return its output."""
    _checkpoint(fn, *args, **kwargs)


def returns_flattened(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The wrong shape: the batch and sequence dimensions folded into one."""
    out = _checkpoint(fn, *args, **kwargs)
    if isinstance(out, tuple):
        return (out[0].flatten(0, 1), *out[1:])
    return out.flatten(0, 1)


def returns_float64(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The wrong dtype: the output in float64, which the model would silently promote."""
    out = _checkpoint(fn, *args, **kwargs)
    if isinstance(out, tuple):
        return (out[0].double(), *out[1:])
    return out.double()


def wrapper_returns_a_str(module: nn.Module) -> nn.Module:
    """A wrapper that returns a name instead of the wrapped module."""
    return "checkpointed"  # type: ignore[return-value]


def wrong_above_four_sequences(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Right for batches of up to 4 sequences; above that, the RNG is not restored (a path
    for big batches that forgets what the small one does)."""
    tensors = [a for a in args if isinstance(a, Tensor) and a.dim() >= 2]
    big = bool(tensors) and tensors[0].shape[0] > 4
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=not big, **kwargs)
