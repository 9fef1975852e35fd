"""The names of the models a case can hold, torch-free: the option parser reads them too.

A case names its model in its JSON (``model_kind``); ``--gradequiv-models`` picks
among the reference models by the same names.
"""

from __future__ import annotations

__all__ = ["BATCHNORM", "DRAWN_MODELS", "EXTERNAL", "MODEL_KINDS", "TRANSFORMER"]

TRANSFORMER = "transformer"  # the reference transformer (models/transformer.py)
BATCHNORM = "batchnorm"  # the BatchNorm MLP of the buffers property (models/batchnorm.py)
EXTERNAL = "external"  # a user's model, named with --model (models/external.py)

#: Every kind a case can hold (report.schema.json lists the same).
MODEL_KINDS = (TRANSFORMER, BATCHNORM, EXTERNAL)
#: The reference models cases are drawn for; ``external`` is a user's model, named with
#: ``--model`` instead.
DRAWN_MODELS = (TRANSFORMER, BATCHNORM)
