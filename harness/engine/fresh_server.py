"""What the fresh processes' fork server runs before it forks any child: torch's lazy
set-up, done once, so that a child pays for its case and not for torch's first op.

Imported by the fork server only (``engine/fresh.py`` preloads it): the import itself
verifies one small case through torch's own checkpoint, at one intra-op thread (a fork
after OpenMP's threads started would leave a child that uses them waiting for ever). No
implementation of the user's is imported or run here.
"""

from __future__ import annotations

import torch

from gradequiv.harness.engine.spread import find_case
from gradequiv.harness.engine.verify import verify
from gradequiv.harness.implementations.resolve import resolve

torch.set_num_threads(1)
verify(resolve("torch"), find_case("1L-layer-dropout"), device="cpu")
