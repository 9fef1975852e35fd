"""Five more things real training does that a recompute must carry: a gradient penalty
(gradients taken with ``create_graph=True``, then backpropagated again), buffers a layer
updates in its training forwards (counters compared exactly), a layer run with autocast
disabled inside an autocast forward, a layer run under ``no_grad`` inside a training
forward (frozen), and memory over steps (a leak or a fallback that starts after the first
step). For each: the case kind or check; torch's built-ins passing it bitwise; a mutant
caught by it and not without it."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from gradequiv.harness import Case, default_cases, find_case, resolve, verify
from gradequiv.harness.engine.compare import Tolerance
from gradequiv.harness.engine.path import build_path
from gradequiv.harness.engine.runner import run_path
from gradequiv.harness.engine.verify import PropertyResult, Verdict
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.faults import MUTANTS, reference_checkpoint, switches
from gradequiv.models import BatchConfig, TransformerConfig, parse_granularity
from gradequiv.models import transformer as transformer_module
from gradequiv.models.kinds import GRAD_MODES, OPT_IN_GRAD_MODES
from gradequiv.properties.strategies import cases, external_cases

CPU = torch.device("cpu")
SMALL = TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=16, attn_dropout=0.1,
                          mlp_dropout=0.1, resid_dropout=0.1)
MANUAL = replace(SMALL, attention="manual")
BATCH = BatchConfig(2, 8)
#: torch's built-ins whose backward goes through the forward's own graph (or its saved
#: tensors, offloaded), so that a second backward is full storage's, bitwise.
DOUBLE_BACKWARD = ("torch", "torch-wrapper", "torch-patched", "torch-offload",
                   "torch-offload-wrapper")
BUILTINS = (*DOUBLE_BACKWARD, "torch-reentrant", "torch-sac")
_BY_NAME = {m.name: m for m in MUTANTS}

PENALTY = {
    "named": find_case("2L-layer-create-graph-manual-attn"),
    "group-shared-x0kw-aux": Case(
        model=replace(MANUAL, aux_loss=True, x0_keyword=True, layer_repeats=2), batch=BATCH,
        granularity=parse_granularity("group:2"), grad_mode="create-graph", inference=True),
    "attention-bf16": Case(model=MANUAL, batch=BATCH, dtype="bf16-autocast",
                           granularity=parse_granularity("attention"),
                           grad_mode="create-graph"),
}
STATS = {
    "named": find_case("2L-layer-running-stats-inference-first"),
    "group-shared-accumulate": Case(
        model=replace(SMALL, running_stats=True, layer_repeats=2), batch=BatchConfig(4, 8),
        granularity=parse_granularity("group:2"), grad_mode="accumulate", inference=True),
    "mlp-bf16-model": Case(model=replace(SMALL, running_stats=True), batch=BATCH,
                           dtype="bf16-model", granularity=parse_granularity("mlp")),
}
ISLAND = {
    "named": find_case("2L-layer-bf16-fp32-last-layer"),
    "attention-fp16": Case(model=replace(SMALL, fp32_last_layer=True), batch=BATCH,
                           dtype="fp16-autocast", granularity=parse_granularity("attention")),
    "3L-every2-bf16": Case(model=replace(SMALL, n_layer=3, fp32_last_layer=True), batch=BATCH,
                           dtype="bf16-autocast", granularity=parse_granularity("every:2")),
}

FROZEN = {
    "named": find_case("2L-layer-frozen-first-layer"),
    "attention-accumulate": Case(model=replace(SMALL, frozen_first_layer=True),
                                 batch=BatchConfig(4, 8), grad_mode="accumulate",
                                 granularity=parse_granularity("attention")),
    "3L-every2-bf16": Case(model=replace(SMALL, n_layer=3, frozen_first_layer=True),
                           batch=BATCH, dtype="bf16-autocast",
                           granularity=parse_granularity("every:2")),
}


#: The case kinds every built-in runs (the third of each kind only where it says).
_EVERY = ("named", "group-shared-accumulate", "attention-fp16", "attention-accumulate")


def _impl(name: str) -> Implementation:
    """A mutant, the fault library's base, or a built-in, by name."""
    if name == "base":
        return Implementation("base", reference_checkpoint)
    if name in _BY_NAME:
        return Implementation(name, _BY_NAME[name].impl)
    return resolve(name)


@cache
def _verdict(name: str, case: Case) -> Verdict:
    return verify(_impl(name), case)


def _bitwise(verdict: Verdict) -> bool:
    return verdict.passed and all(c.mismatched == 0 for p in verdict.properties
                                  for c in p.checks)


def _property(verdict: Verdict, name: str) -> PropertyResult:
    return next(p for p in verdict.properties if p.name == name)


def _drawn(strategy: Any, examples: int = 150) -> list[Case]:
    seen: list[Case] = []

    @settings(max_examples=examples, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case: Case) -> None:
        seen.append(case)

    collect()
    return seen


# -- 1. a gradient penalty: create_graph=True, then backward through that graph -----------

def test_double_backward_is_claimed_by_torch_s_non_reentrant_built_ins_only() -> None:
    """Opt-in: an implementation gets ``create-graph`` only where it claims it."""
    assert OPT_IN_GRAD_MODES == ("create-graph",)
    assert GRAD_MODES.index("create-graph") > GRAD_MODES.index("backward")  # shrinks away
    claims = {spec: "create-graph" in resolve(spec).grad_modes for spec in BUILTINS}
    assert claims == {spec: spec in DOUBLE_BACKWARD for spec in BUILTINS}
    assert "create-graph" not in resolve("torch", kwargs={"use_reentrant": True}).grad_modes
    assert "create-graph" not in resolve("torch-wrapper", kwargs={"reentrant": True}).grad_modes
    assert "create-graph" not in _impl("base").grad_modes
    assert "create-graph" in _impl("grads-without-graph").grad_modes

    def plain(function: Any, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    assert Implementation("plain", plain).grad_modes == ("backward", "autograd-grad",
                                                         "accumulate")
    plain.gradequiv_supports = ("create-graph",)  # type: ignore[attr-defined]
    assert Implementation("plain", plain).grad_modes == GRAD_MODES
    plain.gradequiv_unsupported = ("autograd-grad",)  # type: ignore[attr-defined]
    assert Implementation("plain", plain).grad_modes == ("backward", "accumulate",
                                                         "create-graph")


def test_a_misspelt_grad_mode_declaration_is_a_usage_error() -> None:
    def impl(function: Any, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    impl.gradequiv_supports = ("create_graph",)  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="'create_graph', no grad mode"):
        Implementation("typo", impl)
    impl.gradequiv_supports = "create-graph"  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="a tuple of grad mode names"):
        Implementation("string", impl)


@pytest.mark.parametrize("spec", DOUBLE_BACKWARD)
def test_torch_s_double_backward_built_ins_pass_a_gradient_penalty_bitwise(spec: str) -> None:
    """Bitwise where the second backward runs through the forward's own graph. An offload
    packs copies of what autograd saves and its second backward reads those: on some
    machines the shared-weight group case then differs from full storage in a few elements
    by a relative 1e-9 (bitwise on others): within bound, not bitwise."""
    for name, case in PENALTY.items():
        verdict = _verdict(spec, case)
        if "offload" in spec:
            assert verdict.passed, (name, verdict.first_failure)
        else:
            assert _bitwise(verdict), (name, verdict.first_failure)


@pytest.mark.parametrize(("spec", "message"), [
    ("torch-sac", "only allowed to backward once on any region"),
    ("torch-reentrant", "incompatible with .grad()")])
def test_what_claims_no_double_backward_cannot_run_it(spec: str, message: str) -> None:
    """Their refusal is not caution: forced into a gradient penalty, they raise. The
    selective checkpoint's refusal of a second backward pass is torch's by design: the case
    is not applicable, with torch's message; the reentrant one's is a failure."""
    verdict = _verdict(spec, PENALTY["named"])
    if spec == "torch-sac":
        assert verdict.error is None and message in verdict.not_applicable
    else:
        assert verdict.error is not None and message in verdict.error


def test_a_gradient_penalty_recomputes_once_per_backward_pass() -> None:
    """Two backward passes (create_graph, then through its graph): torch's checkpoint
    re-runs each segment forward once in each, and the recompute property allows it."""
    run = run_path(PENALTY["named"], resolve("torch"), device=CPU)
    assert run.error is None and run.steps[0].calls
    assert all(bwd == 2 * fwd for fwd, bwd, *_ in run.steps[0].calls.values())
    assert _property(_verdict("torch", PENALTY["named"]), "recompute").passed is True


def test_ops_in_the_differentiable_backward_are_no_proof_of_a_recompute() -> None:
    """Under create_graph backward kernels read the weights with grad mode on; counted,
    they would pass a checkpoint that re-runs nothing. Only the last pass is watched."""
    recompute = _property(_verdict("no-op", PENALTY["named"]), "recompute")
    assert recompute.passed is False
    assert "did not run again in backward" in recompute.first_failure


def test_grads_without_graph_is_caught_by_gradients_under_a_penalty_only() -> None:
    penalty = PENALTY["named"]
    caught = _verdict("grads-without-graph", penalty)
    assert caught.error is None, caught.first_failure
    assert caught.first_failure.startswith("gradients:"), caught.first_failure
    worst = max(c.rel_error for c in _property(caught, "gradients").checks)
    assert worst > 1e-2, worst  # a lost term, not the rounding of another graph
    assert _verdict("grads-without-graph", replace(penalty, grad_mode="backward")).passed
    mutant = _BY_NAME["grads-without-graph"]
    assert [s for s in switches() if getattr(mutant.faults, s)] == ["grads_without_graph"]
    assert mutant.source.startswith("https://github.com/pytorch/pytorch/issues/")


def test_the_base_differentiated_twice_is_right_to_rounding_the_mutant_is_not() -> None:
    """The base's second backward runs through its own recompute's graph: in fp32 within
    1e-4 of full storage (it claims no bitwise equality, so no create-graph). Without the
    second-order term through the segments, the mutant is off by more than 1e-2."""
    loose = Tolerance("fp32", rtol=1e-4, atol=1e-6)
    for name in ("named", "group-shared-x0kw-aux"):
        assert verify(_impl("base"), PENALTY[name], tolerance=loose).passed, name
        wrong = verify(_impl("grads-without-graph"), PENALTY[name], tolerance=loose)
        assert wrong.first_failure.startswith("gradients:"), (name, wrong.first_failure)
        worst = max(c.rel_error for c in _property(wrong, "gradients").checks)
        assert worst > 1e-2, (name, worst)


def test_a_gradient_penalty_needs_the_manual_attention_path() -> None:
    with pytest.raises(InvalidArgument, match="no double backward"):
        Case(model=SMALL, grad_mode="create-graph")
    seen = _drawn(cases())
    penalties = [c for c in seen if c.grad_mode == "create-graph"]
    assert penalties and all(isinstance(c.model, TransformerConfig)
                             and c.model.attention == "manual" for c in penalties)
    assert "gradient penalty (create_graph)" in penalties[0].describe()
    assert all(c.grad_mode != "create-graph"
               for c in _drawn(cases(modes=("backward", "autograd-grad")), 40))
    assert all(c.grad_mode != "create-graph"
               for c in _drawn(external_cases("tests.user_models:residual_stack"), 40))


# -- 2. buffers a layer updates in training forwards, counters compared exactly -----------

def test_running_stats_count_training_forwards_and_not_their_recompute() -> None:
    path = build_path(Case(model=replace(SMALL, running_stats=True), batch=BATCH), CPU)
    path.install(resolve("torch"))
    path.model.train()
    path.seed()
    stats = path.model.blocks[0].mlp.stats
    _, loss = path.forward()
    assert (int(stats.num_batches_tracked), int(stats.tokens_seen)) == (1, 16)
    mean = stats.running_mean.clone()
    assert mean.abs().sum() > 0
    loss.backward()  # torch's checkpoint re-runs the layer here: no new batch
    assert int(stats.num_batches_tracked) == 1 and torch.equal(stats.running_mean, mean)
    path.model.eval()
    path.forward()  # an eval forward: not counted
    path.model.train()
    with torch.no_grad():
        path.forward()  # a training forward without backward: counted, as by BatchNorm
    assert (int(stats.num_batches_tracked), int(stats.tokens_seen)) == (2, 32)


@pytest.mark.parametrize("spec", [*BUILTINS, "base"])
def test_every_built_in_leaves_the_counters_exactly_as_full_storage(spec: str) -> None:
    for name, case in STATS.items():
        if name not in _EVERY:
            continue
        verdict = _verdict(spec, case)
        assert verdict.passed, (name, verdict.first_failure)
        counters = [c for c in _property(verdict, "buffers").checks
                    if c.name.endswith(("num_batches_tracked", "tokens_seen"))]
        assert counters and all(c.bound == 0 and c.mismatched == 0 for c in counters)
        assert all(c.mismatched == 0 for c in _property(verdict, "buffers").checks)


def test_bn_stats_in_recompute_only_is_caught_on_transformer_cases_by_buffers() -> None:
    """It restores the buffers after the forward, leaving the update to the recompute,
    which must not count: the update is lost, without a no_grad forward first too."""
    for name, case in [*STATS.items(), ("named-training-only",
                                         replace(STATS["named"], inference=False))]:
        caught = _verdict("bn-stats-in-recompute-only", case)
        assert caught.first_failure.startswith("buffers: buffer "), (name, caught)
        assert "num_batches_tracked" in caught.first_failure
    without = replace(STATS["named"], model=replace(STATS["named"].model, running_stats=False))
    assert _verdict("bn-stats-in-recompute-only", without).passed


def test_torch_s_checkpoint_re_runs_the_forward_and_the_guard_keeps_it_from_counting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the module's check for a re-run inside backward, torch's checkpoint counts
    every batch twice (as it updates BatchNorm's statistics twice, pytorch#96136)."""
    monkeypatch.setattr(transformer_module, "recomputing", lambda: False)
    verdict = verify("torch", replace(STATS["named"], inference=False))
    failure = _property(verdict, "buffers").first_failure
    assert "num_batches_tracked: relative error 0.5 > bound 0" in failure, failure  # 2 vs 1


def test_running_stats_are_drawn_off_first_and_on() -> None:
    seen = [c.model for c in _drawn(cases()) if isinstance(c.model, TransformerConfig)]
    assert {m.running_stats for m in seen} == {False, True}
    assert not TransformerConfig().running_stats
    assert "running stats" in Case(model=replace(SMALL, running_stats=True)).describe()


# -- 3. a layer under autocast(enabled=False) inside an autocast forward ------------------

def test_the_last_layer_runs_with_autocast_disabled_inside_the_autocast_forward() -> None:
    for dtype, last in (("bf16-autocast", torch.float32), ("fp32", torch.float32)):
        path = build_path(Case(model=replace(SMALL, fp32_last_layer=True), batch=BATCH,
                               dtype=dtype), CPU)
        path.install(None)
        seen: dict[int, torch.dtype] = {}
        for i, block in enumerate(path.model.blocks):
            block.attn.qkv.register_forward_hook(
                lambda _m, _a, out, i=i, seen=seen: seen.__setitem__(i, out.dtype))
        path.forward()
        first = torch.bfloat16 if dtype == "bf16-autocast" else torch.float32
        assert seen == {0: first, 1: last}, dtype


@pytest.mark.parametrize("spec", [*BUILTINS, "base"])
def test_every_built_in_recomputes_under_the_autocast_state_of_each_segment(spec: str) -> None:
    for name, case in ISLAND.items():
        if name not in _EVERY:
            continue
        verdict = _verdict(spec, case)
        assert _bitwise(verdict), (name, verdict.first_failure)


def test_autocast_latched_is_caught_by_the_island_and_only_by_it() -> None:
    """One process-wide autocast state: right while every segment of a forward runs under
    the same state, wrong once one runs with autocast disabled."""
    for name, case in ISLAND.items():
        caught = _verdict("autocast-latched", case)
        assert caught.first_failure.startswith("gradients:"), (name, caught.first_failure)
        uniform = replace(case, model=replace(case.model, fp32_last_layer=False))
        assert _verdict("autocast-latched", uniform).passed, name
    one_layer = replace(ISLAND["named"], model=replace(ISLAND["named"].model, n_layer=1))
    assert _verdict("autocast-latched", one_layer).passed  # a single state: nothing to mix
    mutant = _BY_NAME["autocast-latched"]
    assert mutant.source.startswith("https://github.com/")


def test_a_recompute_under_backward_s_autocast_state_needs_no_island() -> None:
    """autocast-lost recomputes under the state of backward time, outside any autocast:
    every autocast case catches it; under the island, only the layers outside it do."""
    named = ISLAND["named"]
    assert _verdict("autocast-lost", named).first_failure.startswith("gradients:")
    uniform = replace(named, model=replace(named.model, fp32_last_layer=False))
    assert not _verdict("autocast-lost", uniform).passed
    inside = replace(named, model=replace(named.model, n_layer=1))  # its one layer: off
    assert _verdict("autocast-lost", inside).passed


def test_the_island_is_drawn_for_autocast_regimes_only() -> None:
    seen = [c for c in _drawn(cases()) if isinstance(c.model, TransformerConfig)]
    autocast = {c.model.fp32_last_layer for c in seen if c.dtype.endswith("-autocast")}
    assert autocast == {False, True}
    assert not any(c.model.fp32_last_layer for c in seen if not c.dtype.endswith("-autocast"))


# -- the named spread ---------------------------------------------------------------------

def test_the_named_spread_has_one_cheap_case_of_each_kind() -> None:
    new = [PENALTY["named"], STATS["named"], ISLAND["named"], FROZEN["named"]]
    assert all(c in default_cases() for c in new)
    assert all(isinstance(c.model, TransformerConfig) and c.model.n_layer == 2
               and c.model.n_embd == 16 for c in new)
    # The penalty is run only where claimed (the suite filters the spread by grad_modes).
    assert PENALTY["named"].grad_mode not in resolve("torch-reentrant").grad_modes
    assert PENALTY["named"].grad_mode in resolve("torch").grad_modes


def test_the_report_schema_knows_every_grad_mode() -> None:
    from gradequiv.harness.reports.bundle import report_schema

    case = report_schema()["$defs"]["case"]["properties"]
    assert case["grad_mode"]["enum"] == list(GRAD_MODES)


# -- 4. a layer under no_grad inside the training forward (frozen) ------------------------

def test_the_first_layer_runs_under_no_grad_inside_the_training_forward() -> None:
    path = build_path(FROZEN["named"], CPU)
    path.install(None)
    grad_mode: dict[int, bool] = {}
    for i, block in enumerate(path.model.blocks):
        block.attn.qkv.register_forward_hook(
            lambda *_, i=i: grad_mode.__setitem__(i, torch.is_grad_enabled()))
    _, loss = path.forward()
    loss.backward()
    assert grad_mode == {0: False, 1: True}
    blocks = path.model.blocks
    assert all(p.grad is None for p in blocks[0].parameters())
    assert all(p.grad is not None for p in blocks[1].parameters())
    assert "first layer under no_grad" in FROZEN["named"].describe()


@pytest.mark.parametrize("spec", [*BUILTINS, "base"])
def test_every_built_in_keeps_a_no_grad_layer_out_of_the_graph(spec: str) -> None:
    for name, case in FROZEN.items():
        if name in _EVERY or spec == "torch":
            verdict = _verdict(spec, case)
            assert _bitwise(verdict), (name, verdict.first_failure)


def test_grad_mode_forced_on_is_caught_by_the_frozen_layer_and_only_by_it() -> None:
    """A checkpoint whose output always requires grad gives the frozen layer, and the
    embedding before it, gradients that full storage leaves None."""
    for name in ("named", "3L-every2-bf16"):
        caught = _verdict("grad-mode-forced-on", FROZEN[name])
        assert caught.first_failure.startswith("gradients: grad of blocks.0."), \
            (name, caught.first_failure)
        assert "exists only on the recompute path" in caught.first_failure
        thawed = replace(FROZEN[name], model=replace(FROZEN[name].model,
                                                     frozen_first_layer=False))
        assert _verdict("grad-mode-forced-on", thawed).passed, name
    assert _BY_NAME["grad-mode-forced-on"].source.startswith("https://github.com/")


def test_a_segment_run_under_no_grad_has_nothing_to_recompute() -> None:
    """Its forward saved nothing: no re-run is asked of it, and one would be a fault."""
    full = run_path(FROZEN["named"], None, device=CPU)
    assert full.steps[0].calls["blocks.0"] == [1, 0, 0]  # one forward, none with grad on
    assert full.steps[0].calls["blocks.1"] == [1, 0, 1]
    recompute = _property(_verdict("torch", FROZEN["named"]), "recompute")
    assert recompute.passed is True
    only_frozen = replace(FROZEN["named"], granularity=parse_granularity("every:2"))
    skipped = _property(_verdict("torch", only_frozen), "recompute")
    assert skipped.passed is None and "under no_grad" in skipped.summary
    forced = _property(_verdict("grad-mode-forced-on", FROZEN["named"]), "recompute")
    assert any("its forward ran under no_grad" in f for f in forced.failures)


def test_the_frozen_layer_is_drawn_off_first_outside_layer_groups() -> None:
    seen = [c for c in _drawn(cases()) if isinstance(c.model, TransformerConfig)]
    assert {c.model.frozen_first_layer for c in seen} == {False, True}
    frozen = [c for c in seen if c.model.frozen_first_layer]
    assert all(c.model.n_layer > 1 for c in frozen)
    assert not any(str(c.granularity).startswith("group") for c in frozen)
    assert not TransformerConfig().frozen_first_layer


# -- 5. memory over steps: what a later step holds and leaves -------------------------------

def test_held_and_leaked_bytes_are_counted_at_every_step() -> None:
    run = run_path(FROZEN["named"], resolve("torch"), device=CPU, count_memory=True)
    held = [s.held_bytes for s in run.steps]
    left = [s.left_bytes for s in run.steps]
    assert len(held) == 2 and all(h is not None and h > 0 for h in held)
    assert held[0] == run.held_bytes and held[1] == held[0]  # the same shapes, step after step
    assert left == [0, 0]


def test_a_stash_that_fills_from_the_second_step_is_caught_at_that_step() -> None:
    """Nothing leaks at step 1, so a leak check of the first step alone passes it."""
    caught = _property(_verdict("stash-kept-after-warmup", FROZEN["named"]), "recompute")
    assert caught.passed is False
    assert caught.failures[0].startswith("step 2: ") and "still alive after its backward" \
        in caught.failures[0]
    # a leak from step 1 on is named at step 2 too: step 1 may allocate once (a pool)
    from_start = _property(_verdict("saved-inputs-kept", FROZEN["named"]), "recompute")
    assert from_start.failures[0].startswith("step 2: ")
    assert _BY_NAME["stash-kept-after-warmup"].source.startswith("https://github.com/")


def test_a_recompute_that_stops_freeing_after_the_first_step_is_caught_at_that_step() -> None:
    from gradequiv.harness.engine.runner import PathRun, StepRecord
    from gradequiv.harness.engine.verify import _check_freed

    def run(*held: int) -> PathRun:
        t = torch.zeros(1)
        return PathRun(steps=[StepRecord(t, t, {}, {}, {}, {}, held_bytes=h) for h in held],
                       held_bytes=held[0])

    result = PropertyResult("recompute", True)
    _check_freed(run(100, 100), run(60, 60), result)
    assert result.failures == []
    _check_freed(run(100, 100), run(60, 100), result)
    assert result.failures == ["step 2: activation bytes held between forward and backward: "
                               "100 on the recompute path, 100 on the full-storage path; "
                               "nothing was freed"]


def test_a_selective_policy_s_bytes_are_reported_not_failed() -> None:
    """torch's SAC with matmul outputs saved keeps an attention-only segment's costly ops
    (SDPA, both projections): more bytes than full storage, by its policy's choice. Marked
    selective, it is reported; unmarked too, told by the ops its re-run skipped."""
    from gradequiv.harness.implementations.torch_builtins import torch_sac

    case = Case(model=replace(SMALL, n_layer=1, attn_dropout=0.0, resid_dropout=0.0,
                              mlp_dropout=0.0), batch=BATCH,
                granularity=parse_granularity("attention"))
    marked = verify(resolve("torch-sac"), case)
    assert marked.held_bytes["recompute"] >= marked.held_bytes["full"]
    reported = _property(marked, "recompute")
    assert reported.passed is True and "selective recompute held" in reported.summary

    def unmarked(function: Any, *args: Any, **kwargs: Any) -> Any:
        return torch_sac(function, *args, **kwargs)

    told = _property(verify(Implementation("sac-unmarked", unmarked), case), "recompute")
    assert told.passed is True and "re-run skipped" in told.summary
