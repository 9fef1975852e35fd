"""The README's example says what the code does: the autocast bug is caught, the fix passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradequiv.harness import default_cases, verify

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _small_cases() -> list:
    """The small cases of the spread the examples support (not ``torch.autograd.grad``,
    which they declare unsupported, nor a gradient penalty, which they do not claim)."""
    return [c for c in default_cases() if "128" not in c.name
            and c.grad_mode not in ("autograd-grad", "create-graph")]


@pytest.mark.slow
def test_the_hand_written_recompute_fails_exactly_the_autocast_cases() -> None:
    failed = {c.name for c in _small_cases() if not verify("hand_written:my_checkpoint", c).passed}
    assert failed == {c.name for c in _small_cases() if c.dtype.endswith("-autocast")}


def test_the_examples_declare_autograd_grad_unsupported() -> None:
    from gradequiv.harness import resolve

    for name in ("my_checkpoint", "my_checkpoint_fixed"):
        assert "autograd-grad" not in resolve(f"hand_written:{name}").grad_modes


@pytest.mark.slow
def test_the_fixed_hand_written_recompute_passes() -> None:
    for case in _small_cases():
        verdict = verify("hand_written:my_checkpoint_fixed", case)
        assert verdict.passed, (case.name, verdict.first_failure)
