"""What an implementation declares on itself (``gradequiv_unsupported``,
``gradequiv_supports``, ``gradequiv_strategy``) is read from it on every route: ``check``,
the plugin's option, a conftest's fixture and the Python API."""

from __future__ import annotations

import pytest

from gradequiv.harness import Implementation, find_case, resolve, verify
from gradequiv.harness.cli import main

SUITE = ["--pyargs", "gradequiv.properties", "-p", "no:cacheprovider"]
AUTOGRAD_CASE = "2L-layer-autograd-grad-dropout"
FIXTURE = (
    "import pytest, correct_impls\n"
    "from gradequiv.harness import Implementation\n"
    "@pytest.fixture(scope='session')\n"
    "def recompute_impl():\n"
    "    return Implementation('mine', correct_impls.{name})\n"
)


def test_the_python_api_does_not_hold_a_declared_refusal_against_it() -> None:
    verdict = verify("correct_impls:declared_reentrant_checkpoint", find_case(AUTOGRAD_CASE))
    assert verdict.passed and verdict.error is None
    assert all(p.passed is None and "gradequiv_unsupported" in p.summary
               for p in verdict.properties)


def test_an_undeclared_refusal_still_fails() -> None:
    verdict = verify("correct_impls:undeclared_reentrant_checkpoint", find_case(AUTOGRAD_CASE))
    assert not verdict.passed and "incompatible with .grad()" in (verdict.error or "")


def test_declines_says_whose_declaration_it_is() -> None:
    declared = resolve("correct_impls:declared_reentrant_checkpoint")
    assert declared.declines("backward") == ""
    assert "gradequiv_unsupported = ('autograd-grad',)" in declared.declines("autograd-grad")
    assert "opt-in" in declared.declines("create-graph")
    told = Implementation("torch", resolve("torch").target, kwargs={"use_reentrant": True})
    assert "reentrant" in told.declines("autograd-grad")


def test_the_fixture_route_reads_the_declaration(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FIXTURE.format(name="declared_reentrant_checkpoint"))
    result = pytester.runpytest(*SUITE, f"--gradequiv-case={AUTOGRAD_CASE}", "-rs")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("skipped", 0) >= 1, outcomes
    result.stdout.fnmatch_lines(["*gradequiv_unsupported*"])


def test_the_fixture_route_draws_around_the_declaration(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FIXTURE.format(name="declared_reentrant_checkpoint"))
    result = pytester.runpytest(*SUITE, "--gradequiv-examples=3", "-k",
                                f"test_gradients or {AUTOGRAD_CASE}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) == 1, outcomes


def test_without_the_declaration_the_fixture_route_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FIXTURE.format(name="undeclared_reentrant_checkpoint"))
    result = pytester.runpytest(*SUITE, f"--gradequiv-case={AUTOGRAD_CASE}",
                                "-k", "test_gradients")
    result.assert_outcomes(failed=1)


def test_check_refuses_a_case_the_implementation_declines(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--impl", "correct_impls:declared_reentrant_checkpoint",
                 "--case", AUTOGRAD_CASE, "--in-process"])
    assert code == 2
    assert "gradequiv_unsupported" in capsys.readouterr().err


def test_the_plugin_option_route_reads_it_too(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*SUITE, "--gradequiv-impl=correct_impls:"
                                "declared_reentrant_checkpoint", "--gradequiv-examples=3",
                                "-k", f"test_gradients or {AUTOGRAD_CASE}")
    result.assert_outcomes(passed=1)  # the named case is not in its spread at all
