"""The compile regime: SPECs that are compiler settings, checked against compiled full storage.

The tests marked ``compile`` run inductor (a C++ compiler on the CPU); each
compiles a small model under two settings, tens of seconds when inductor's
cache is cold.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gradequiv.harness import InvalidArgument, find_case, resolve, verify
from gradequiv.harness.engine.localise import localise
from gradequiv.harness.implementations.compiled import (
    REFERENCE,
    CompileSettings,
    compile_model,
    parse,
)
from gradequiv.models import build, parse_granularity


def test_compile_specs_parse_into_settings() -> None:
    assert parse("compile-budget:0.5").settings == CompileSettings(0.5)
    assert parse("compile-sac:matmuls").policy == "matmuls"
    assert parse("compile-torch").kind == "torch"
    impl = resolve("compile-budget:0")
    assert impl.compiled is not None and impl.compiled.budget == 0.0
    assert impl.command_args() == ["--impl", "compile-budget:0"]


@pytest.mark.parametrize(("spec", "names"), [
    ("compile-budget:1.5", "from 0 to 1"),
    ("compile-budget:half", "from 0 to 1"),
    ("compile-budget:", "from 0 to 1"),
    ("compile-sac:everything", "matmuls, none, all"),
    ("compile-torch:0.5", "takes no value"),
    ("compile-inductor", "budget, sac, torch"),
])
def test_malformed_compile_specs_say_what_is_wrong(spec: str, names: str) -> None:
    with pytest.raises(InvalidArgument, match=names) as raised:
        resolve(spec)
    assert repr(spec) in str(raised.value)


def test_a_compile_spec_takes_no_adapter() -> None:
    with pytest.raises(InvalidArgument, match="takes no --adapter"):
        resolve("compile-torch", adapter="wrapper")


def test_localisation_says_plainly_that_it_cannot_look_inside_a_compiled_graph() -> None:
    found = localise(resolve("compile-budget:0"), find_case("compile-2L-layer-dropout"))
    assert found.divergence is None and "compiled graph" in found.reason


def _compiled_gradients(settings: CompileSettings, case_name: str) -> list[torch.Tensor]:
    """One compiled step, outside the harness: the ground truth its verdicts must agree with."""
    case = find_case(case_name)
    workload = build(case.model, case.batch, case.seed, torch.device("cpu"))
    model = compile_model(workload.model, settings)
    workload.model.train()
    torch.default_generator.manual_seed(case.seed + 1)
    workload.loss_fn(model(*workload.inputs), workload.targets).backward()
    return [p.grad.clone() for p in workload.model.parameters() if p.grad is not None]


@pytest.mark.compile
def test_the_gradients_verdict_agrees_with_a_direct_comparison_of_compiled_gradients() -> None:
    """At budget 0 the partitioner may recompute dropout in backward with fresh masks
    (pytorch/pytorch#190758, present in torch 2.13): whatever this torch does, the
    verdict must say what a plain comparison of the two compiled programs says."""
    name = "compile-2L-layer-dropout"
    with torch.random.fork_rng():
        ours = _compiled_gradients(CompileSettings(0.0), name)
        reference = _compiled_gradients(REFERENCE, name)
    differ = any(not torch.equal(a, b) for a, b in zip(ours, reference))
    verdict = verify("compile-budget:0", find_case(name))
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert gradients.passed is (not differ), gradients.summary
    # fp32: the compiled floor is zero, so the bound stays at reordering slack
    assert all(c.floor == 0 and c.bound < 1e-5 for c in gradients.checks)
    recompute = next(p for p in verdict.properties if p.name == "recompute")
    assert recompute.passed, recompute.summary  # budget 0 keeps almost nothing
    held = verdict.held_bytes
    assert held["recompute"] is not None and held["full"] is not None
    assert held["recompute"] < held["full"] / 4


@pytest.mark.compile
def test_sac_under_compile_passes_within_the_compiled_bf16_floor_and_saves_memory() -> None:
    """In bf16 the floor is how far the compiled reference moves when inductor rounds where
    it likes instead of where eager does: a recompute fused elsewhere moves that much."""
    case = replace(find_case("compile-2L-layer-manual-attn-dropout"), dtype="bf16-autocast")
    verdict = verify("compile-sac:matmuls", case)
    assert verdict.passed, verdict.first_failure
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert max(c.floor for c in gradients.checks) > 0
    summary = next(p for p in verdict.properties if p.name == "recompute").summary
    assert "compiled graph" in summary


@pytest.mark.compile
def test_a_policy_that_saves_everything_is_caught_freeing_nothing() -> None:
    verdict = verify("compile-sac:all", find_case("compile-2L-layer-dropout"))
    recompute = next(p for p in verdict.properties if p.name == "recompute")
    assert recompute.passed is False and "nothing was freed" in recompute.summary
    assert all(p.passed is not False for p in verdict.properties if p.name != "recompute")


@pytest.mark.compile
def test_a_budget_acts_on_the_whole_graph_even_with_no_segment_selected() -> None:
    case = replace(find_case("compile-2L-layer-nodropout"),
                   granularity=parse_granularity("none"))
    verdict = verify("compile-budget:0.5", case)
    recompute = next(p for p in verdict.properties if p.name == "recompute")
    assert recompute.passed is True, recompute.summary


@pytest.mark.compile
def test_a_verdict_does_not_depend_on_whether_inductor_compiled_afresh_or_from_its_cache() -> None:
    """The backward must compile under the setting too: compiled lazily at the first
    backward, it once took whatever configuration was global then, and a bf16 case
    gave 0 from a warm cache and 3e-3 from a cold one."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    case = replace(find_case("compile-2L-layer-manual-attn-dropout"), dtype="bf16-autocast",
                   seed=27281)

    def errors() -> list[float]:
        verdict = verify("compile-budget:0.5", case)
        return [c.rel_error for p in verdict.properties for c in p.checks]

    cached = errors()
    with functorch_config.patch(enable_autograd_cache=False), \
            inductor_config.patch(fx_graph_cache=False):
        afresh = errors()
    assert afresh == cached
