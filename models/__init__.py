"""Reference models whose segments go through the recompute under test.

``build(model_config, batch_config, seed)`` returns a :class:`Workload`: the
model with freshly initialised weights, one fixed batch, and its loss.

The names below load on first use, so that ``gradequiv.models.kinds`` (the
model names, which the option parser reads in every pytest run) imports
without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradequiv.harness.errors import InvalidArgument
    from gradequiv.models.batchnorm import BatchNormConfig, BatchNormNet
    from gradequiv.models.external import ExternalConfig, UserModel
    from gradequiv.models.granularity import (
        AttentionOnly,
        EveryKthLayer,
        EveryLayer,
        Granularity,
        LayerGroups,
        MlpOnly,
        NoRecompute,
        layer_runs,
        parse_granularity,
    )
    from gradequiv.models.kinds import DRAWN_MODELS, MODEL_KINDS
    from gradequiv.models.segments import Router, Segment
    from gradequiv.models.transformer import (
        DROPOUT_SITES,
        ELEMENT_DROPOUT_SITES,
        Transformer,
        TransformerConfig,
    )
    from gradequiv.models.workload import BatchConfig, ModelConfig, Workload, build, make_batch

#: module (under gradequiv) -> the public names it defines
_MODULES = {
    "harness.errors": ("InvalidArgument",),
    "models.batchnorm": ("BatchNormConfig", "BatchNormNet"),
    "models.external": ("ExternalConfig", "UserModel"),
    "models.granularity": ("AttentionOnly", "EveryKthLayer", "EveryLayer", "Granularity",
                           "LayerGroups", "MlpOnly", "NoRecompute", "layer_runs",
                           "parse_granularity"),
    "models.kinds": ("DRAWN_MODELS", "MODEL_KINDS"),
    "models.segments": ("Router", "Segment"),
    "models.transformer": ("DROPOUT_SITES", "ELEMENT_DROPOUT_SITES", "Transformer",
                           "TransformerConfig"),
    "models.workload": ("BatchConfig", "ModelConfig", "Workload", "build", "make_batch"),
}
_WHERE = {name: f"gradequiv.{module}" for module, names in _MODULES.items() for name in names}

# A literal, so that mypy sees the exports; tests/test_models.py checks it against _WHERE.
__all__ = [
    "DRAWN_MODELS",
    "DROPOUT_SITES",
    "ELEMENT_DROPOUT_SITES",
    "MODEL_KINDS",
    "AttentionOnly",
    "BatchConfig",
    "BatchNormConfig",
    "BatchNormNet",
    "EveryKthLayer",
    "EveryLayer",
    "ExternalConfig",
    "Granularity",
    "InvalidArgument",
    "LayerGroups",
    "MlpOnly",
    "ModelConfig",
    "NoRecompute",
    "Router",
    "Segment",
    "Transformer",
    "TransformerConfig",
    "UserModel",
    "Workload",
    "build",
    "layer_runs",
    "make_batch",
    "parse_granularity",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
