"""A small MLP with BatchNorm: the model for the buffers property.

BatchNorm updates its running statistics in every training-mode forward, so
a recompute that re-runs the forward updates them twice unless it guards
them. Its input is a float tensor that requires grad, so the input gradient
of the model itself is observed too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor, nn

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.granularity import SINGLE_LAYERS, Granularity
from gradequiv.models.segments import (
    RoutedModel,
    Router,
    Segment,
    attach_router,
    layer_segments,
)


@dataclass(frozen=True)
class BatchNormConfig:
    n_layer: int = 2
    width: int = 16
    n_classes: int = 4
    dropout: float = 0.0
    momentum: float = 0.1
    # Dropout and ReLU in place on the normalised activations (torchvision's ResNets run
    # BatchNorm then ReLU(inplace=True)): a recompute that caches an output and re-applies
    # an in-place op on it differs exactly there. Dropout comes first then (the same
    # values): ReLU in place on its own output would overwrite what its backward reads.
    inplace_ops: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layer", "width", "n_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name}={value!r}: must be a whole number >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidArgument(f"dropout={self.dropout!r}: a probability in [0, 1) is needed")

    @property
    def has_randomness(self) -> bool:
        return self.dropout > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class NormBlock(nn.Module):
    def __init__(self, config: BatchNormConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, config.width)
        self.bn = nn.BatchNorm1d(config.width, momentum=config.momentum)
        self.inplace = config.inplace_ops
        self.act = nn.ReLU(inplace=self.inplace)
        self.dropout = nn.Dropout(config.dropout, inplace=self.inplace)

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace:
            branch: Tensor = self.act(self.dropout(self.bn(self.fc(x))))
        else:
            branch = self.dropout(self.act(self.bn(self.fc(x))))
        return x + branch


class BatchNormNet(RoutedModel):
    router: Router

    def __init__(self, config: BatchNormConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(NormBlock(config) for _ in range(config.n_layer))
        self.head = nn.Linear(config.width, config.n_classes)
        attach_router(self)

    def segments(self, granularity: Granularity) -> list[Segment]:
        """Layer-level granularities only: the blocks have no attention or MLP parts."""
        if not isinstance(granularity, SINGLE_LAYERS):
            raise InvalidArgument(
                f"granularity={str(granularity)!r} does not apply to the batchnorm model; "
                f"use none, layer or every:K"
            )
        return layer_segments(granularity, [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)])

    def forward(self, features: Tensor) -> Tensor:
        x = features
        for block in self.blocks:
            x = self.router(block, x)
        logits: Tensor = self.head(x)
        return logits
