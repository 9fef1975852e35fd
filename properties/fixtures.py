"""The property suite's fixture, as a module the plugin registers only on a run that asked
for gradequiv (a user's own suite keeps the name ``recompute_impl`` for itself). A module,
not an instance: pytest deprecates fixtures defined as instance methods."""

from __future__ import annotations

from typing import Any

import pytest

from gradequiv.properties import runtime


@pytest.fixture(scope="session")
def recompute_impl() -> Any:
    """The implementation under test; override this fixture in a conftest to supply your
    own."""
    from gradequiv.harness import InvalidArgument

    if not runtime.RUN.options.impl:
        pytest.fail("no implementation to check: pass --gradequiv-impl SPEC (or set "
                    "GRADEQUIV_IMPL), or override the recompute_impl fixture", pytrace=False)
    try:
        return runtime.RUN.implementation()
    except InvalidArgument as exc:
        pytest.fail(str(exc), pytrace=False)
