"""Checkpoints right only in one training regime (``--impl regime_impls:NAME``): a check
that draws every regime fails them; one stated as the regime they are right in passes them.
Both are torch's non-reentrant checkpoint with a re-run context of their own.

- ``one_pass_checkpoint``: restores the RNG state it kept, consuming it: the first backward
  pass through the call has it. Exact where each forward has one backward (a whole batch
  per step, GPipe, 1F1B); wrong where a loss is backpropagated in parts, and under torch's
  zero-bubble schedules, whose weight pass is a second backward through the same call.
- ``bf16_one_pass_checkpoint``: that, and written for one AMP recipe: its re-run enters
  autocast as the forward found it but always in bf16 (the device's usual dtype, not the
  caller's): wrong under fp16 autocast too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


class _RngOnce:
    """The re-run's context: the RNG state of the forward, given to the first re-run only
    (a class: torch enters it once per backward pass); under ``dtype``, autocast as the
    forward found it on or off, in that dtype."""

    def __init__(self, device: str, dtype: torch.dtype | None) -> None:
        self.device, self.dtype = device, dtype
        self.enabled = torch.is_autocast_enabled(device)
        self.kept = [torch.get_rng_state()]
        self.entered: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        self.entered = contextlib.ExitStack()
        self.entered.enter_context(torch.random.fork_rng(devices=[]))
        if self.kept:
            torch.set_rng_state(self.kept.pop())
        if self.dtype is not None:
            self.entered.enter_context(torch.autocast(self.device, dtype=self.dtype,
                                                      enabled=self.enabled))

    def __exit__(self, *exc: Any) -> None:
        assert self.entered is not None
        self.entered.__exit__(*exc)


def _checkpoint(dtype: torch.dtype | None, function: Any, *args: Any, **kwargs: Any) -> Any:
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    rerun = _RngOnce(device, dtype)
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False,
                      context_fn=lambda: (contextlib.nullcontext(), rerun), **kwargs)


def one_pass_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint, its RNG state consumed by the first backward pass
    (see the module's doc)."""
    return _checkpoint(None, function, *args, **kwargs)


def bf16_one_pass_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """That, its re-run in bf16 autocast whatever the caller's dtype (see the module's
    doc)."""
    return _checkpoint(torch.bfloat16, function, *args, **kwargs)
