"""Implementations that change one of torch's process-global switches and leave it changed.

Each is torch's own non-reentrant checkpoint plus one switch set inside the call and
never put back, as a recompute that sets its own precision or thread count and forgets
the caller's might; ``restores_what_it_changes`` sets the same switches and puts them
back before it returns, which is fine. Referenced by SPEC (``leaky_impls:NAME``); pytest
puts this folder on sys.path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def _checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def leaves_float64_default(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Recompute right; the default dtype left at float64."""
    out = _checkpoint(fn, *args, **kwargs)
    torch.set_default_dtype(torch.float64)
    return out


def leaves_grad_disabled(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Grad mode switched off globally after the segment's forward and left off: what runs
    after it builds no graph, so the step's backward raises. (Switched off in a backward
    hook it would not leak: the autograd engine puts grad mode back after each node.)"""
    out = _checkpoint(fn, *args, **kwargs)
    torch.set_grad_enabled(False)
    return out


def leaves_one_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Recompute right; the intra-op thread count changed and left changed."""
    out = _checkpoint(fn, *args, **kwargs)
    torch.set_num_threads(torch.get_num_threads() + 1)
    return out


def leaves_matmul_precision(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Recompute right; the float32 matmul precision lowered to 'medium' and left there
    (on the CPU that lets oneDNN run float32 matmuls in bfloat16)."""
    out = _checkpoint(fn, *args, **kwargs)
    torch.set_float32_matmul_precision("medium")
    return out


def restores_what_it_changes(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Sets all four switches around its call and puts each back before returning."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    precision = torch.get_float32_matmul_precision()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(threads + 1)
    torch.set_float32_matmul_precision("medium")
    try:
        with torch.no_grad():
            torch.zeros(1)  # something runs while they are set
        return _checkpoint(fn, *args, **kwargs)
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
