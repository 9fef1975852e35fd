"""pytester for the plugin tests, each in-process run starting as a fresh process would;
torch's lazy imports done once, up front.

pytester's in-process runs drop the modules they imported when they end;
torch._dynamo (imported lazily by optimizers and checkpoint) registers
operator libraries that cannot be registered twice, so it must be imported
before the first inner run.
"""

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo  # noqa: F401
import torch.utils.checkpoint  # noqa: F401

pytest_plugins = ["pytester"]


@pytest.fixture
def pytester(pytester: pytest.Pytester) -> Iterator[pytest.Pytester]:
    """pytester whose in-process runs see what a fresh process in its folder sees: an
    empty Hypothesis database there (not the one earlier runs of this process filled,
    whose saved cases an inner run would replay first), the suite's strategies built
    anew, and torch's RNG, default dtype and threads as the outer test left them."""
    from hypothesis import configuration

    from gradequiv.properties import strategies

    home = configuration.storage_directory().home_directory
    configuration.set_hypothesis_home_dir(pytester.path / ".hypothesis")
    _clear_strategy_caches(strategies)
    rng, dtype, threads = torch.get_rng_state(), torch.get_default_dtype(), torch.get_num_threads()
    try:
        yield pytester
    finally:
        configuration.set_hypothesis_home_dir(home)
        _clear_strategy_caches(strategies)
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)


def _clear_strategy_caches(module: object) -> None:
    for value in vars(module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
