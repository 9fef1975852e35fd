"""Checkpoints right only in one training regime (``--impl regime_impls:NAME``): a check
that draws every regime fails them; one stated as the regime they are right in passes them.

- ``bf16_one_pass_checkpoint``: written for one AMP recipe (bf16 autocast, one backward per
  step) on torch's non-reentrant checkpoint. Its re-run enters autocast as the forward found
  it but always in bf16 (the device's usual dtype, not the caller's: wrong under fp16
  autocast), and it restores the RNG state it kept, consuming it (the first backward pass
  has it: a loss backpropagated in parts re-runs its dropout with other masks).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


class _Bf16Rerun:
    """The re-run's context: a class, as torch enters it once per backward pass."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.enabled = torch.is_autocast_enabled(device)
        self.kept = [torch.get_rng_state()]  # given to the first re-run only
        self.fork: Any = None
        self.autocast: Any = None

    def __enter__(self) -> None:
        self.fork = torch.random.fork_rng(devices=[])
        self.fork.__enter__()
        if self.kept:
            torch.set_rng_state(self.kept.pop())
        self.autocast = torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.enabled)
        self.autocast.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.autocast.__exit__(*exc)
        self.fork.__exit__(*exc)


def bf16_one_pass_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint, its re-run in bf16 autocast and its RNG state
    consumed by the first backward pass (see the module's doc)."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    rerun = _Bf16Rerun(device)
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False,
                      context_fn=lambda: (contextlib.nullcontext(), rerun), **kwargs)
