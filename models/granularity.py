"""Which segments recompute: typed configuration, one class per mode.

Text forms (for the command line and reports): ``none``, ``layer``,
``every:K`` (every K-th layer, starting with layer 0), ``group:K``
(consecutive groups of K layers, each recomputed as one segment),
``attention`` (the attention sub-block of every layer), ``mlp``; ``toggle``: where a
toggle chooses the segments itself (a user's model, every named segment watched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gradequiv.harness.errors import InvalidArgument


@dataclass(frozen=True)
class NoRecompute:
    """Keep every activation (the full-storage reference, or a control case)."""

    kind: ClassVar[str] = "none"

    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True)
class EveryLayer:
    """Recompute each layer from its input."""

    kind: ClassVar[str] = "layer"

    def __str__(self) -> str:
        return "layer"


@dataclass(frozen=True)
class TogglesOwn(EveryLayer):
    """Whatever a toggle that chooses its own segments checkpoints: it is handed no
    selection, so every named segment is watched, and one such case stands for every
    granularity (``layer`` and ``every:2`` would be the same configuration)."""

    kind: ClassVar[str] = "toggle"

    def __str__(self) -> str:
        return "toggle"


@dataclass(frozen=True)
class EveryKthLayer:
    """Recompute layers 0, k, 2k, ...; the others keep their activations."""

    k: int
    kind: ClassVar[str] = "every"

    def __post_init__(self) -> None:
        _check_positive("every", self.k)

    def __str__(self) -> str:
        return f"every:{self.k}"


@dataclass(frozen=True)
class LayerGroups:
    """Recompute groups of ``size`` consecutive layers, each group one segment."""

    size: int
    kind: ClassVar[str] = "group"

    def __post_init__(self) -> None:
        _check_positive("group", self.size)

    def __str__(self) -> str:
        return f"group:{self.size}"


@dataclass(frozen=True)
class AttentionOnly:
    """Recompute only the attention sub-block of every layer."""

    kind: ClassVar[str] = "attention"

    def __str__(self) -> str:
        return "attention"


@dataclass(frozen=True)
class MlpOnly:
    """Recompute only the feed-forward sub-block of every layer."""

    kind: ClassVar[str] = "mlp"

    def __str__(self) -> str:
        return "mlp"


Granularity = (
    NoRecompute | EveryLayer | EveryKthLayer | LayerGroups | AttentionOnly | MlpOnly
)

_PLAIN: dict[str, Granularity] = {
    "none": NoRecompute(),
    "layer": EveryLayer(),
    "toggle": TogglesOwn(),
    "attention": AttentionOnly(),
    "mlp": MlpOnly(),
}
_WITH_K: dict[str, type[EveryKthLayer | LayerGroups]] = {
    "every": EveryKthLayer,
    "group": LayerGroups,
}


def parse_granularity(text: str) -> Granularity:
    """Parse a granularity's text form (``layer``, ``every:2``, ``group:2``, ...)."""
    name, _, arg = text.strip().partition(":")
    if name in _PLAIN and not arg:
        return _PLAIN[name]
    if name in _WITH_K:
        try:
            k = int(arg)
        except ValueError:
            raise InvalidArgument(
                f"granularity={text!r}: {name!r} needs a whole number after the colon; "
                f"write e.g. '{name}:2'"
            ) from None
        return _WITH_K[name](k)
    known = ", ".join([*_PLAIN, "every:K", "group:K"])
    raise InvalidArgument(f"granularity={text!r} is not one of {known}; pick one of those")


def _check_positive(name: str, k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidArgument(f"granularity {name}:{k!r}: K must be a whole number >= 1")


#: The granularities whose segments are whole single layers: all that a model without
#: sub-blocks or layer groups (the batchnorm model, a user's model) supports.
SINGLE_LAYERS = (NoRecompute, EveryLayer, EveryKthLayer)


def layer_runs(granularity: Granularity, n_layers: int) -> list[range]:
    """The layers ``granularity`` recomputes out of ``n_layers``, one range of consecutive
    layer indices per segment, in call order.

    The one rule every model shares; the model maps each range to its modules. A sub-layer
    granularity (attention, mlp) selects every layer, one at a time: which sub-block of it
    recomputes is the model's part.
    """
    if isinstance(granularity, NoRecompute):
        return []
    if isinstance(granularity, (EveryLayer, AttentionOnly, MlpOnly)):
        step = size = 1
    elif isinstance(granularity, EveryKthLayer):
        step, size = granularity.k, 1
    elif isinstance(granularity, LayerGroups):
        step = size = granularity.size
    else:
        raise InvalidArgument(f"granularity={granularity!r} is not a known granularity")
    return [range(start, min(start + size, n_layers)) for start in range(0, n_layers, step)]
