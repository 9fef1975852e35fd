"""An in-process pytest run inside a test starts from the state a fresh process has
(tests/conftest.py's ``pytester``): what an earlier inner run saved or built must not
change what a later one draws."""

from __future__ import annotations

import pytest
from hypothesis import settings


def test_an_inner_run_uses_an_example_database_of_its_own(pytester: pytest.Pytester) -> None:
    """Hypothesis replays the cases its database holds before it draws: a database shared
    with the inner runs before (the outer session's .hypothesis/) made a 3-example run
    replay their cases instead of drawing its own."""
    from hypothesis.configuration import storage_directory

    # where the database is when one is used (not under CI, where Hypothesis's own ci profile
    # keeps none)
    examples = storage_directory("examples").path
    assert str(pytester.path) in str(examples), examples
    database = settings.default.database
    assert database is None or str(pytester.path) in str(getattr(database, "path", ""))


def test_the_suites_strategies_are_built_anew_for_an_inner_run(
        request: pytest.FixtureRequest) -> None:
    from gradequiv.properties import strategies

    strategies.dropout_regimes()  # built here, in the outer session
    cached = [value for value in vars(strategies).values()
              if callable(getattr(value, "cache_info", None))]
    assert any(value.cache_info().currsize for value in cached)
    request.getfixturevalue("pytester")
    assert all(value.cache_info().currsize == 0 for value in cached)
