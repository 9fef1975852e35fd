"""The property suite: one test per property, over cases Hypothesis draws.

Run it with ``pytest --pyargs gradequiv.properties --gradequiv-impl SPEC``
(``gradequiv check`` does exactly that). All seven tests draw the same cases
from the same seed, and verdicts are cached per case, so each case runs down
its paths once; pytest-xdist may still spread the tests over workers. A test
first tries the minimal failures earlier tests of its process shrank to, and
fails on one of them at once if its property fails there too: one fault is
shrunk once, not once per property it breaks. ``test_named_case`` runs the
fixed spread every time, whatever is drawn.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as conjecture_engine

from gradequiv.harness import (
    PROPERTIES,
    Case,
    Implementation,
    default_cases,
    extra_cases,
    find_case,
)
from gradequiv.harness.engine.spread import compile_cases, load_case
from gradequiv.harness.implementations.compiled import is_compile_spec
from gradequiv.models.kinds import BATCHNORM
from gradequiv.properties import runtime
from gradequiv.properties.assertions import (
    assert_known_failures,
    assert_property,
    search_further,
)
from gradequiv.properties.strategies import cases, compiled_cases, external_cases

OPTIONS = runtime.RUN.options


def _drawn_cases() -> st.SearchStrategy[Case]:
    if OPTIONS.case is not None:
        return st.just(load_case(OPTIONS.case))
    device = runtime.RUN.device().type
    regime = OPTIONS.regime  # what the user's training runs: only that is drawn
    if is_compile_spec(OPTIONS.impl):
        return compiled_cases(device=device, regime=regime)
    modes = runtime.RUN.grad_modes()  # what it declares it does not do is not drawn
    if OPTIONS.model is not None:
        chooses = OPTIONS.impl is not None and runtime.RUN.implementation().chooses_segments
        return external_cases(OPTIONS.model, device=device, modes=modes,
                              toggle_chooses=chooses, regime=regime)
    return cases(device=device, models=OPTIONS.models, modes=modes, regime=regime)


# Shrinking stops after a number of shrinks (MAX_SHRINKS), never after minutes of wall clock
# (Hypothesis's 300 s): a slower machine must not report another minimal failure.
if hasattr(conjecture_engine, "MAX_SHRINKING_SECONDS"):
    conjecture_engine.MAX_SHRINKING_SECONDS = 10**9


def _suite(test: Callable[..., None]) -> Callable[..., None]:
    """Given drawn cases, with the run's seed and its profile's settings."""
    default = settings.default
    assert default is not None  # None only while hypothesis itself is being imported
    # Compiled cases differ only in seed and precision: shrinking would walk the seed down
    # at seconds per try (a failing 3-example run: 16 minutes with it, 41 s without).
    shrink = OPTIONS.shrink and not is_compile_spec(OPTIONS.impl)
    profile = settings(
        max_examples=1 if OPTIONS.case is not None else OPTIONS.max_examples,
        deadline=None,
        database=None if OPTIONS.profile == "ci" else default.database,
        derandomize=False,  # the run's seed decides the draws (see the header line)
        print_blob=True,
        # No explain phase: it re-runs variations of each minimal failure to say which
        # arguments did not matter, most of a failing run's time for a line few read.
        phases=[p for p in Phase if p != Phase.explain and (shrink or p != Phase.shrink)],
        # Same seed, same run, failing too: Hypothesis would otherwise go on looking for other
        # bugs for 10 s of wall clock after the first one (how many cases then run depends on
        # the machine's speed), and only the first minimal failure of a test is reported.
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                               HealthCheck.data_too_large],
    )
    search = profile(seed(OPTIONS.draw_seed)(given(case=_drawn_cases())(test)))
    # A failing test's further searches for other causes (``search_further``): the same
    # draws, none saved to the example database (a failure of a known cause passes there).
    further = settings(profile, database=None)(
        seed(OPTIONS.draw_seed)(given(case=_drawn_cases())(test)))
    prop = test.__name__.removeprefix("test_")

    @functools.wraps(search)
    def run(recompute_impl: Implementation, request: Any) -> None:
        try:
            # A fault usually fails several properties: where a minimal case an earlier test
            # shrank to fails this one too, it is this test's failure, found without a search.
            assert_known_failures(prop, recompute_impl, request.node)
            search(recompute_impl=recompute_impl, request=request)
        except pytest.fail.Exception:
            search_further(recompute_impl, request.node,
                           lambda: further(recompute_impl=recompute_impl, request=request))
            raise

    return run


@_suite
def test_gradients(recompute_impl: Implementation, case: Case, request: Any) -> None:
    assert_property("gradients", recompute_impl, case, request.node)


@_suite
def test_outputs(recompute_impl: Implementation, case: Case, request: Any) -> None:
    assert_property("outputs", recompute_impl, case, request.node)


@_suite
def test_buffers(recompute_impl: Implementation, case: Case, request: Any) -> None:
    assert_property("buffers", recompute_impl, case, request.node)


@_suite
def test_rng(recompute_impl: Implementation, case: Case, request: Any) -> None:
    assert_property("rng", recompute_impl, case, request.node)


@_suite
def test_trajectory(recompute_impl: Implementation, case: Case, request: Any) -> None:
    assert_property("trajectory", recompute_impl, case, request.node)


@_suite
def test_inference(recompute_impl: Implementation, case: Case, request: Any) -> None:
    assert_property("inference", recompute_impl, case, request.node)


@_suite
def test_recompute(recompute_impl: Implementation, case: Case, request: Any) -> None:
    assert_property("recompute", recompute_impl, case, request.node)


def _spread() -> list[Case]:
    """The fixed spread: ours (the compile spread for compiled implementations; with the
    BatchNorm model drawn too, its named cases), or for a user's model every segment in
    each precision."""
    if OPTIONS.model is None:
        if is_compile_spec(OPTIONS.impl):
            return compile_cases()
        modes = runtime.RUN.grad_modes()
        named = default_cases()
        if BATCHNORM in OPTIONS.models:
            named += [c for c in extra_cases() if c.model_kind == BATCHNORM]
        return [c for c in named if c.grad_mode in modes and not runtime.RUN.declines(c)
                and not runtime.RUN.outside_regime(c)]
    from gradequiv.models import ExternalConfig

    model = ExternalConfig(OPTIONS.model)
    own = [Case(model=model, dtype=dtype, name=f"model-layer-{dtype}")
           for dtype in ("fp32", "bf16-autocast")]
    # the training loops real code runs, on the factory's own batch and loss
    own += [Case(model=model, name="model-layer-gpipe", schedule="gpipe"),
            Case(model=model, name="model-layer-two-losses", backward_passes=2)]
    return [c for c in own if not runtime.RUN.declines(c) and not runtime.RUN.outside_regime(c)]


def _named(name: str) -> Case:
    return next(c for c in _spread() if c.name == name) if OPTIONS.model else find_case(name)


if OPTIONS.case is None:  # replaying one case runs the seven properties on it alone
    runtime.RUN.named = [c.with_seed_offset(OPTIONS.seed) for i, c in enumerate(_spread())
                         if OPTIONS.in_shard(i)]

    @pytest.mark.parametrize(
        "name", [c.name for i, c in enumerate(_spread()) if OPTIONS.in_shard(i)])
    def test_named_case(recompute_impl: Implementation, name: str, request: Any) -> None:
        """The fixed spread: every property on each named case, each verified as the first
        case of a fresh process (state an implementation keeps across cases cannot hide a
        fault that a new training process meets: ``assert_property`` sets that up)."""
        case = _named(name).with_seed_offset(OPTIONS.seed)
        for prop in PROPERTIES:
            assert_property(prop, recompute_impl, case, request.node)
