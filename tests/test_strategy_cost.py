"""The cost of drawing a case, counted as work: a shrink draws hundreds of cases, and a
strategy built anew on every draw is validated anew (it was two thirds of a draw)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from gradequiv.properties import strategies
from gradequiv.properties.strategies import cases


def _draw(strategy: st.SearchStrategy[Any], n: int) -> list[str]:
    drawn: list[str] = []

    @seed(3)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case: Any) -> None:
        drawn.append(case.to_json())

    collect()
    return drawn


@pytest.mark.parametrize("models", [("transformer",), ("transformer", "batchnorm")])
def test_drawing_more_cases_builds_no_more_strategies(
        monkeypatch: pytest.MonkeyPatch, models: tuple[str, ...]) -> None:
    strategy = cases(models=models)
    _draw(strategy, 40)  # every combination of arguments met once
    built: list[str] = []
    for name in ("sampled_from", "integers", "booleans", "tuples", "builds"):
        original = getattr(st, name)

        def counting(*args: Any, _original: Any = original, _name: str = name,
                     **kwargs: Any) -> Any:
            built.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(strategies.st, name, counting)
    assert len(set(_draw(strategy, 40))) > 20  # real, varied draws
    assert built == []
