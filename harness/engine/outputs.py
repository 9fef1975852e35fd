"""What a model or a segment returns, whatever its shape: a tensor, or any pytree of them.

Library models return structures: transformers' ``ModelOutput`` and diffusers'
``BaseOutput`` (ordered dicts whose unset fields are ``None``), dataclasses,
named tuples, dicts, lists. Every command reads outputs through these two
functions, so none of them meets a structure it cannot walk.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

__all__ = ["main_output", "tensor_leaves"]


def tensor_leaves(item: Any) -> list[Tensor]:
    """Every tensor in ``item``, in order: a tensor, or any nesting of dicts (ModelOutput
    included), tuples (named ones included), lists and dataclasses; ``None`` and other
    values are left out."""
    if isinstance(item, Tensor):
        return [item]
    if isinstance(item, dict):
        return [t for value in item.values() for t in tensor_leaves(value)]
    if isinstance(item, (tuple, list)):
        return [t for value in item for t in tensor_leaves(value)]
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return [t for f in dataclasses.fields(item) for t in tensor_leaves(getattr(item, f.name))]
    return []


#: The field a structured output keeps its prediction in, by library convention:
#: transformers' ``logits`` and ``last_hidden_state``, diffusers' ``sample``.
_MAIN_FIELDS = ("logits", "last_hidden_state", "sample", "prediction", "output")


def main_output(outputs: Any) -> Tensor:
    """The tensor the outputs property compares: the output itself, a structure's
    prediction field (``logits``, ``last_hidden_state``, ``sample``), or its first tensor."""
    if isinstance(outputs, Tensor):
        return outputs
    for name in _MAIN_FIELDS:
        value = outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name, None)
        if isinstance(value, Tensor):
            return value
    leaves = tensor_leaves(outputs)
    if not leaves:
        raise TypeError(f"the model returned {type(outputs).__name__} with no tensor in it")
    return leaves[0]
