"""What a factory returns for ``--model``: a model, its fixed batch, its loss, its segments.

Its own module, below both routes that build one: a factory of the user's
(``models/external.py`` runs it) and a library's architecture by name
(``models/library.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

__all__ = ["SegmentName", "UserModel"]

#: A segment as a factory names it: a dotted submodule name, or a module class (every
#: instance of it, outermost ones, in the model's order).
SegmentName = str | type[nn.Module]


@dataclass
class UserModel:
    """What a factory returns: everything the harness needs to train one fixed batch.

    ``inputs``: the positional arguments of ``model.forward`` (a tuple), or its keyword
    arguments (a dict); ``keyword_inputs`` adds keywords after positional ones (T5's
    ``input_ids=..., decoder_input_ids=...`` without ``None`` placeholders between them).
    ``segments``: dotted names of the submodules to recompute, or module classes (every
    instance). ``regimes``: the precision regimes the model runs (None: every one); the
    others are "not applicable to this model".
    """

    model: nn.Module
    inputs: tuple[Tensor | None, ...] | dict[str, Tensor | None]
    targets: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]
    segments: Sequence[SegmentName]
    keyword_inputs: dict[str, Tensor | None] = field(default_factory=dict)
    regimes: tuple[str, ...] | None = None

    @property
    def positional(self) -> tuple[Tensor | None, ...]:
        """The positional inputs (none where ``inputs`` is a dict)."""
        return () if isinstance(self.inputs, dict) else tuple(self.inputs)

    @property
    def keywords(self) -> dict[str, Tensor | None]:
        """Every keyword input: ``inputs`` as a dict, then ``keyword_inputs``."""
        given = self.inputs if isinstance(self.inputs, dict) else {}
        return {**given, **self.keyword_inputs}

    def flat_inputs(self) -> tuple[Tensor | None, ...]:
        """Positional inputs, then the keyword inputs' values: the one tuple the harness
        carries (``ExternalModel.forward`` hands them back by keyword)."""
        return (*self.positional, *self.keywords.values())

    def input_names(self) -> list[str]:
        """``arg0``, ``arg1``, ... for positional inputs, the keyword for the others."""
        return [f"arg{i}" for i in range(len(self.positional))] + list(self.keywords)
