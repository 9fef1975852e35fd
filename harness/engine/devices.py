"""Which device a run uses: ``auto`` is CUDA when torch sees a GPU, else the CPU."""

from __future__ import annotations

import torch

from gradequiv.harness.errors import InvalidArgument


def resolve_device(choice: str, *, flag: str = "--device") -> torch.device:
    """The device for ``choice`` (auto, cpu, cuda); CUDA asked for but absent is a caller's
    mistake, not a run of failures."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(
            f"{flag}='cuda' but torch.cuda.is_available() is False (a CPU build of torch, "
            f"or no GPU visible); use {flag} cpu or auto"
        )
    return torch.device(choice)
