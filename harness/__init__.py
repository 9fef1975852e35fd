"""The engine: run full storage and recompute on one fixed batch and compare.

``verify(impl, case)`` returns a :class:`Verdict` with every metric; no
Hypothesis in here (the property layer only chooses cases).
"""

from gradequiv.harness.adapters import Implementation, parse_impl_kwargs, resolve
from gradequiv.harness.case import DTYPES, Case
from gradequiv.harness.compare import PairMetrics, Tolerance, measure_pairs
from gradequiv.harness.spread import default_cases, extra_cases, find_case
from gradequiv.harness.verify import PROPERTIES, PropertyResult, TensorCheck, Verdict, verify
from gradequiv.models import InvalidArgument

__all__ = [
    "DTYPES",
    "PROPERTIES",
    "Case",
    "Implementation",
    "InvalidArgument",
    "PairMetrics",
    "PropertyResult",
    "TensorCheck",
    "Tolerance",
    "Verdict",
    "default_cases",
    "extra_cases",
    "find_case",
    "measure_pairs",
    "parse_impl_kwargs",
    "resolve",
    "verify",
]
