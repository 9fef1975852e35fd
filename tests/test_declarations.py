"""What an implementation declares on itself (``gradequiv_unsupported``,
``gradequiv_supports``, ``gradequiv_strategy``) is read from it on every route: ``check``,
the plugin's option, a conftest's fixture and the Python API."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from gradequiv.harness import (
    Case,
    Implementation,
    default_cases,
    extra_cases,
    find_case,
    resolve,
    verify,
)
from gradequiv.harness.cli import main
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.resolve import BUILTINS, builtin_target
from gradequiv.models.kinds import GRAD_MODES, SCHEDULES

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


# -- a built-in's declaration is a claim: torch (or its library) refuses loudly there ----------

def _builtin_declarations() -> list[tuple[str, str]]:
    """(built-in, declined name) for each name in a built-in's ``gradequiv_unsupported``."""
    return [(spec, name) for spec in BUILTINS
            for name in getattr(builtin_target(spec), "gradequiv_unsupported", ())]


def _declined_cases(name: str) -> list[Case]:
    """The named cases asking for grad mode ``name`` or having feature ``name``: every one
    a declaration declines, each a small one."""
    cases = [c for c in default_cases() + extra_cases()
             if c.grad_mode == name or name in c.features()]
    assert cases, f"no named case asks for {name!r}: the declaration is untested"
    return cases


def _undeclared(impl: Implementation) -> Implementation:
    """``impl`` with its ``gradequiv_unsupported`` taken off (its signature, strategy and
    other claims kept)."""
    target: Callable[..., Any] = functools.wraps(impl.target)(
        lambda *args, **kwargs: impl.target(*args, **kwargs))
    vars(target).pop("gradequiv_unsupported", None)
    return Implementation(impl.spec, target, impl.adapter, dict(impl.kwargs),
                          default_adapter=impl.default_adapter)


def _without(case: Case, name: str) -> Case:
    """``case`` without grad mode or feature ``name``: every other knob kept."""
    if name in GRAD_MODES:
        return replace(case, grad_mode="backward")
    if name == "inplace-ops":
        return replace(case, model=replace(case.model, inplace_ops=False))
    fields = {"retain-graph": {"backward_passes": 1},
              "backward-autocast": {"backward_autocast": False}}
    return replace(case, **fields.get(name, {"schedule": "one"} if name in SCHEDULES
                                      else {"trainable": "all"}))


def _not_refused_loudly(impl: Implementation, name: str) -> list[str]:
    """The named cases with ``name`` on which ``impl``, its declaration ignored, does not
    raise (nor get a refusal verify names as loud), or raises on the same case without
    ``name`` too (a crash, not a refusal of ``name``)."""
    undeclared = _undeclared(impl)
    quiet = []
    for case in _declined_cases(name):
        assert not undeclared.declines(case.grad_mode, case.features())
        verdict = verify(undeclared, case)
        loud = verdict.error is not None or all(
            "a loud refusal" in p.summary for p in verdict.properties)
        plain = _without(case, name)
        if not loud or verify(undeclared, plain).error is not None:
            quiet.append(case.name)
    return quiet


def test_the_builtin_declarations_are_found() -> None:
    assert ("torch-reentrant", "autograd-grad") in _builtin_declarations()


@pytest.mark.parametrize(("spec", "declined"), _builtin_declarations())
def test_each_builtin_declaration_has_a_loud_refusal_behind_it(spec: str,
                                                               declined: str) -> None:
    try:
        impl = resolve(spec)
    except InvalidArgument as exc:  # its library is not installed, or it needs CUDA
        pytest.skip(f"{spec} cannot run here: {exc}")
    quiet = _not_refused_loudly(impl, declined)
    assert not quiet, (f"{spec} declares gradequiv_unsupported = ({declined!r},) but, "
                       f"without the declaration, does not refuse loudly on {quiet}")


def test_a_declaration_without_a_refusal_behind_it_is_caught() -> None:
    """torch's non-reentrant checkpoint takes torch.autograd.grad: a declaration that it
    refuses it is false, and the check above says so."""
    assert _not_refused_loudly(resolve("torch"), "autograd-grad") == [
        "2L-layer-autograd-grad-dropout"]


@pytest.mark.slow
def test_torch_s_own_refusal_by_design_is_not_applicable_and_the_check_passes(
        tmp_path: Any, capfd: pytest.CaptureFixture[str]) -> None:
    """A user's checkpoint built on torch's selective checkpoint, no declaration: the cases
    torch refuses by design (a second backward pass) are not applicable, named with torch's
    message, and the gate passes (issue 50)."""
    import json

    code = main(["check", "--impl", "correct_impls:user_selective_checkpoint",
                 "--report-dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "report.json").read_text())
    refused = report["not_applicable"]
    assert "test_named_case[2L-layer-two-losses-dropout]" in refused
    assert all("Trying to backward an extra time" in reason or "has been mutated" in reason
               for reason in refused.values()), refused
    assert {report["tests"][test] for test in refused} == {"not applicable"}
    assert "not applicable: test_named_case[2L-layer-two-losses-dropout]" in out


def _raises_torch_s_words(fn: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Trying to backward an extra time. (the user's own words)")


def test_the_same_refusal_from_the_user_s_code_still_fails() -> None:
    from gradequiv.harness.errors import torch_refusal

    verdict = verify(Implementation("own", _raises_torch_s_words), find_case("1L-layer-dropout"))
    assert not verdict.passed and verdict.not_applicable == ""
    assert torch_refusal(verdict.error or "") == ""
    sac = verify(resolve("correct_impls:user_selective_checkpoint"),
                 find_case("2L-layer-two-losses-dropout"))
    assert sac.passed and "second backward pass" in sac.not_applicable
