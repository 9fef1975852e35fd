"""The compile regime: recompute that torch.compile decides or compiles.

Three kinds of implementation are compiler settings rather than Python
functions, each named by a SPEC:

- ``compile-budget:X``: the whole model compiled with AOTAutograd's
  ``activation_memory_budget = X``; the partitioner chooses what to recompute.
- ``compile-sac:POLICY``: torch's checkpoint with a selective-checkpoint
  policy (``matmuls``, ``none``, ``all``) on each selected segment, inside a
  compiled model.
- ``compile-torch``: torch's non-reentrant checkpoint on each selected
  segment, inside a compiled model.

Compiled code draws random numbers its own way (inductor generates dropout
masks from seeds, not from eager's kernels), so the reference is never eager:
it is the same model compiled with torch's defaults and nothing recomputed on
purpose. Both paths compile with ``fullgraph=True`` (a graph break would hand
half the model back to eager without a word), ``dynamic=False``, and with
inductor's ``emulate_precision_casts``: without it, an op that the partitioner
recomputes inside a fused backward kernel skips the bf16 rounding that the
forward did, and gradients move by about 1e-4 relative for no fault of the
recompute (docs/compile.md).

Compiling costs seconds per model and setting; dynamo traces each path's
model anew (a new module is a new guard), and the compiled graphs come back
from inductor's and AOTAutograd's caches when shapes and settings repeat.
One backend object per setting keeps dynamo from serving a graph compiled
under one budget to another.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.torch_builtins import (
    SAC_POLICIES,
    torch_checkpoint,
    torch_sac,
)

PREFIX = "compile-"
KINDS = ("budget", "sac", "torch")


@dataclass(frozen=True)
class CompileSettings:
    """How one path is compiled; ``budget=None`` keeps torch's default partitioner."""

    budget: float | None = None
    exact_casts: bool = True  # inductor's emulate_precision_casts


REFERENCE = CompileSettings()
#: The noise floor of a compiled reference: the same program, rounding where inductor
#: rounds by default rather than where eager does.
FLOOR = CompileSettings(exact_casts=False)


@dataclass(frozen=True)
class CompileSpec:
    """A parsed ``compile-...`` SPEC."""

    kind: str  # one of KINDS
    budget: float | None = None  # for "budget"
    policy: str | None = None  # for "sac"

    @property
    def settings(self) -> CompileSettings:
        return CompileSettings(self.budget)


def is_compile_spec(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def parse(spec: str) -> CompileSpec:
    """``compile-budget:0.5``, ``compile-sac:matmuls``, ``compile-torch``."""
    kind, _, value = spec[len(PREFIX):].partition(":")
    examples = "compile-budget:0.5, compile-sac:matmuls or compile-torch"
    if kind not in KINDS:
        raise InvalidArgument(f"--impl={spec!r}: {kind!r} is not one of {', '.join(KINDS)}; "
                              f"write e.g. {examples}")
    if kind == "torch":
        if value:
            raise InvalidArgument(f"--impl={spec!r}: compile-torch takes no value; "
                                  f"write compile-torch")
        return CompileSpec("torch")
    if kind == "sac":
        if value not in SAC_POLICIES:
            raise InvalidArgument(f"--impl={spec!r}: the policy {value!r} is not one of "
                                  f"{', '.join(SAC_POLICIES)}; write e.g. compile-sac:matmuls")
        return CompileSpec("sac", policy=value)
    try:
        budget = float(value)
    except ValueError:
        budget = float("nan")
    if not 0.0 <= budget <= 1.0:
        raise InvalidArgument(f"--impl={spec!r}: the budget {value!r} is not a number from 0 "
                              f"to 1 (the share of activation memory the partitioner may "
                              f"keep); write e.g. compile-budget:0.5")
    return CompileSpec("budget", budget=budget)


def segment_call(spec: CompileSpec) -> Callable[..., Any]:
    """What each selected segment is called through inside the compiled model."""
    if spec.kind == "sac":
        return functools.partial(torch_sac, policy=spec.policy or "matmuls")
    if spec.kind == "torch":
        return torch_checkpoint
    return _as_is


def _as_is(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A budget leaves segments alone: the partitioner decides over the whole graph."""
    return function(*args, **kwargs)


@functools.cache
def _backend(settings: CompileSettings) -> Callable[..., Any]:
    """Inductor, with this setting's budget applied while the joint graph is partitioned.

    One backend object per setting: dynamo keys its cache on the backend too,
    so a graph compiled under one budget is never reused under another.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with warnings.catch_warnings():  # torch.jit deprecations at import: nothing to act on
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch._inductor.compile_fx import compile_fx

    # The backward is compiled now, under these patches: lazily, at the first backward, it
    # would compile under whatever configuration is global then.
    patches: dict[str, Any] = {"force_non_lazy_backward_lowering": True}
    if settings.budget is not None:
        patches["activation_memory_budget"] = settings.budget

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
        with functorch_config.patch(patches), \
                inductor_config.patch(emulate_precision_casts=settings.exact_casts):
            return compile_fx(graph, example_inputs)

    return backend


def compile_model(model: nn.Module, settings: CompileSettings) -> nn.Module:
    """``model`` compiled whole, for one path.

    Dynamo's in-memory cache is emptied first: the previous path's entries
    guard on modules that are gone, and left there they would count towards
    the recompile limit, past which dynamo runs eager (here: raises).
    """
    import torch._dynamo
    import torch._dynamo.config as dynamo_config

    torch._dynamo.reset()
    dynamo_config.fail_on_recompile_limit_hit = True
    compiled: nn.Module = torch.compile(  # type: ignore[assignment]  # returns a callable
        model, backend=_backend(settings), fullgraph=True, dynamic=False)
    return compiled
