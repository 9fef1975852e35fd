"""torch's process-global switches: each case starts from them, and one an implementation
leaves changed fails the ``rng`` property and never reaches the next case."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import leaky_impls
import pytest
import torch

from gradequiv.harness import Case, Implementation, Verdict, verify
from gradequiv.harness.engine import global_state
from gradequiv.harness.engine import verify as verify_module
from gradequiv.models import BatchConfig, TransformerConfig, parse_granularity

CASE = Case(
    model=TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=16, embd_dropout=0.1,
                            attn_dropout=0.1, resid_dropout=0.1, mlp_dropout=0.1),
    batch=BatchConfig(2, 8), granularity=parse_granularity("layer"), seed=3, name="t",
)
LEAK = "the implementation changed torch's global state and did not restore it: "


@pytest.fixture(autouse=True)
def _switches_put_back() -> Iterator[None]:
    """A test that fails (or a harness that leaks) must not change the tests after it."""
    before = global_state.snapshot()
    yield
    global_state.restore(before)


def run(fn: Any) -> Verdict:
    return verify(Implementation(fn.__name__, fn, "function"), CASE)


def rng(verdict: Verdict) -> Any:
    return next(p for p in verdict.properties if p.name == "rng")


@pytest.mark.parametrize("fn, change", [
    (leaky_impls.leaves_float64_default, "default dtype torch.float32 -> torch.float64"),
    (leaky_impls.leaves_grad_disabled, "grad enabled True -> False"),
    (leaky_impls.leaves_one_thread, "intra-op threads "),
    (leaky_impls.leaves_matmul_precision, "float32 matmul precision 'highest' -> 'medium'"),
])
def test_a_switch_left_changed_fails_rng_and_is_put_back(fn: Any, change: str) -> None:
    before = global_state.snapshot()
    verdict = run(fn)
    assert not verdict.passed
    prop = rng(verdict)
    assert prop.passed is False and prop.first_failure.startswith(LEAK)
    assert change in prop.first_failure and change in verdict.first_failure
    assert global_state.diff(before, global_state.snapshot()) == []  # put back after the case


def test_left_grad_mode_off_is_named_beside_the_error_it_causes() -> None:
    """Grad mode left off: the rest of the forward builds no graph and backward raises; the
    verdict says both, since the switch is why."""
    verdict = run(leaky_impls.leaves_grad_disabled)
    assert verdict.error is not None and "does not require grad" in verdict.first_failure
    assert "rng: " + LEAK + "grad enabled True -> False" in verdict.first_failure
    assert torch.is_grad_enabled()


def test_torch_checkpoint_leaves_the_switches_as_full_storage_does() -> None:
    verdict = verify("torch", CASE)
    assert verdict.passed, verdict.first_failure
    assert "torch's global switches as full storage left them" in rng(verdict).summary


def test_switches_set_and_restored_inside_the_call_are_fine() -> None:
    verdict = run(leaky_impls.restores_what_it_changes)
    assert verdict.passed, verdict.first_failure


def test_the_case_after_a_leak_runs_in_float32() -> None:
    assert not run(leaky_impls.leaves_float64_default).passed
    assert torch.get_default_dtype() == torch.float32
    seen: list[torch.dtype] = []

    def records_dtype(fn: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_default_dtype())
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    assert run(records_dtype).passed
    assert seen and set(seen) == {torch.float32}


def test_every_path_starts_from_the_switches_the_case_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever one path leaves (here: each path, after it ran), the next starts clean."""
    real, starts = verify_module.run_path, []

    def leaky_path(*args: Any, **kwargs: Any) -> Any:
        starts.append(torch.get_default_dtype())
        done = real(*args, **kwargs)
        torch.set_default_dtype(torch.float64)
        return done

    monkeypatch.setattr(verify_module, "run_path", leaky_path)
    assert verify("torch", CASE, always_floor=True).passed  # the floor path too: three
    assert starts == [torch.float32] * 3
    assert torch.get_default_dtype() == torch.float32


def test_the_run_s_own_deterministic_switch_is_the_clean_state() -> None:
    """--deterministic is set by the run before any case: kept for every path, not undone."""
    seen: list[bool] = []

    def records(fn: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(torch.are_deterministic_algorithms_enabled())
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    torch.use_deterministic_algorithms(True)
    assert run(records).passed
    assert seen and all(seen) and torch.are_deterministic_algorithms_enabled()


# -- the module itself ------------------------------------------------------------------------


def _other(value: object) -> object:
    """A different valid value for a switch."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, torch.dtype):
        return torch.float64 if value != torch.float64 else torch.float16
    if isinstance(value, torch.device):
        return torch.device("meta")
    if value in ("highest", "high", "medium"):
        return "medium" if value != "medium" else "highest"
    assert isinstance(value, str), value
    return "ieee" if value == "tf32" else "tf32"  # "none" (inherited) is "ieee" in effect


SETTABLE = [s for s in global_state._SWITCHES
            if s.set is not None and global_state._read(s) is not global_state._ABSENT]


@pytest.mark.parametrize("switch", SETTABLE, ids=[s.label for s in SETTABLE])
def test_each_switch_is_seen_named_and_put_back(switch: Any) -> None:
    before = global_state.snapshot()
    assert switch.set is not None
    switch.set(_other(global_state._read(switch)))
    changed = global_state.diff(before, global_state.snapshot())
    assert changed
    if switch.label not in global_state._FP32_PARENTS:  # a parent shows in the ops it sets
        assert any(line.startswith(switch.label + " ") for line in changed), changed
    assert global_state.restore(before) == []
    assert global_state.snapshot() == before


def test_the_snapshot_names_the_switches_the_issue_lists() -> None:
    labels = {label for label, _ in global_state.snapshot().values}
    assert {"default dtype", "grad enabled", "deterministic algorithms", "intra-op threads",
            "autocast on cpu", "autocast on cuda", "autocast dtype on cpu",
            "float32 matmul precision", "cudnn benchmark", "cudnn deterministic",
            "cudnn allow_tf32", "cuda matmul allow_tf32", "flash SDPA",
            "memory-efficient SDPA", "math SDPA"} <= labels
    assert global_state.snapshot().get("default dtype") == torch.float32


def test_the_legacy_precision_saved_and_restored_is_no_change() -> None:
    """set_float32_matmul_precision('highest') puts back 'ieee' where the per-backend setting
    said 'none' (inherit): the same precision, so no change."""
    before = global_state.snapshot()
    torch.set_float32_matmul_precision("medium")
    assert global_state.diff(before, global_state.snapshot())
    torch.set_float32_matmul_precision("highest")
    assert global_state.diff(before, global_state.snapshot()) == []


def test_what_cannot_be_put_back_is_said() -> None:
    before = global_state.snapshot()
    with torch.inference_mode():
        assert global_state.restore(before) == ["inference mode False -> True"]
    assert global_state.diff(before, global_state.snapshot()) == []


# -- global module hooks ----------------------------------------------------------------------


def test_a_global_forward_hook_left_registered_fails_rng_naming_it_and_is_removed() -> None:
    """Not "nondeterministic": the hook is named, and no later path runs it."""
    import wrong_impls
    from torch.nn.modules import module as nn_module

    verdict = run(wrong_impls.leaves_a_forward_hook)
    prop = rng(verdict)
    assert prop.passed is False and prop.first_failure.startswith(LEAK)
    assert ("global module forward hooks: added wrong_impls._nudges_outputs"
            in prop.first_failure)
    assert "nondetermin" not in verdict.first_failure
    assert not nn_module._global_forward_hooks  # removed after the case
    assert verify("torch", CASE).passed  # the next case runs without it


def _identity_hook(*args: Any, **kwargs: Any) -> None:
    return None


HOOK_KINDS = [
    ("global module forward hooks", "register_module_forward_hook"),
    ("global module forward pre-hooks", "register_module_forward_pre_hook"),
    ("global module backward hooks", "register_module_full_backward_hook"),
    ("global module backward pre-hooks", "register_module_full_backward_pre_hook"),
    ("global module buffer registration hooks", "register_module_buffer_registration_hook"),
    ("global module parameter registration hooks",
     "register_module_parameter_registration_hook"),
    ("global module registration hooks", "register_module_module_registration_hook"),
]


@pytest.mark.parametrize("label, register", HOOK_KINDS, ids=[k[0] for k in HOOK_KINDS])
def test_each_kind_of_global_module_hook_is_seen_named_and_removed(
        label: str, register: str) -> None:
    from torch.nn.modules import module as nn_module

    before = global_state.snapshot()
    full_backward = nn_module._global_is_full_backward_hook
    getattr(nn_module, register)(_identity_hook)
    changed = global_state.diff(before, global_state.snapshot())
    assert changed == [f"{label}: added test_global_state._identity_hook"]
    assert global_state.restore(before) == []
    assert global_state.snapshot() == before
    assert nn_module._global_is_full_backward_hook is full_backward


def test_a_global_hook_the_implementation_removed_is_put_back() -> None:
    from torch.nn.modules import module as nn_module

    handle = nn_module.register_module_forward_hook(_identity_hook, always_call=True)
    try:
        before = global_state.snapshot()
        handle.remove()
        assert global_state.diff(before, global_state.snapshot()) == [
            "global module forward hooks: removed test_global_state._identity_hook"]
        assert global_state.restore(before) == []
        assert list(nn_module._global_forward_hooks.values()) == [_identity_hook]
        assert nn_module._global_forward_hooks_always_called == {handle.id: True}
    finally:
        handle.remove()


def test_the_regimes_switches_are_set_back_to_torchs_defaults_and_then_put_back() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_autocast_enabled("cpu", True)
    torch.set_grad_enabled(False)
    changed = global_state.pin_regime()
    now = (torch.get_default_dtype(), torch.is_autocast_enabled("cpu"), torch.is_grad_enabled())
    global_state.unpin(changed)
    assert now == (torch.float32, False, True)
    assert set(changed) == {"default dtype", "autocast on cpu", "grad enabled"}
    assert torch.get_default_dtype() == torch.float64 and torch.is_autocast_enabled("cpu")
    assert not torch.is_grad_enabled()
    assert "default dtype was torch.float64" in global_state.pinned_lines(changed)[0]


def test_an_implementation_whose_import_sets_the_default_dtype_is_checked_in_its_regime(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A module that sets torch's default dtype when imported ran every fp32 case in
    float64, and the report said fp32 and pass: the cases run as their regimes say, the
    run says what it set back, and the caller gets its float64 back."""
    import json

    from gradequiv.harness.cli import main

    seen = tmp_path / "seen"
    (tmp_path / "float64_impl.py").write_text(
        "import pathlib, torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "torch.set_default_dtype(torch.float64)\n\n\n"
        "def my_checkpoint(function, *args, **kwargs):\n"
        f"    pathlib.Path({str(seen)!r}).write_text(\n"
        "        f'{args[0].dtype} {torch.get_default_dtype()}')\n"
        "    return checkpoint(function, *args, use_reentrant=False, **kwargs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = main(["check", "--in-process", "--impl", "float64_impl:my_checkpoint",
                     "--case", "1L-layer-dropout", "--report-dir", str(tmp_path / "r")])
        after = torch.get_default_dtype()
    finally:
        torch.set_default_dtype(torch.float32)
    out = capsys.readouterr().out
    assert code == 0, out
    assert seen.read_text() == "torch.float32 torch.float32"
    assert "note: torch's default dtype was torch.float64 before the run" in out
    conditions = json.loads((tmp_path / "r" / "report.json").read_text())["conditions"]
    assert conditions["set_to_torch_defaults"][0].startswith("default dtype was torch.float64")
    assert after == torch.float64  # the caller's, put back
