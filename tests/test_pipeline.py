"""torch's own pipeline schedules on two gloo ranks: the reference transformer split into
stages, trained by each schedule of torch 2.13, full storage against torch's checkpoint
(bitwise equal, dropout on), and a checkpoint that does not restore the RNG caught. The ranks
start once for the module and train every schedule and path in turn."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gradequiv.harness import find_case
from gradequiv.harness.engine.path import prepare
from gradequiv.harness.engine.pipeline import (
    PIPELINE_SCHEDULES,
    Pipelining,
    pipeline_refusal,
    split_stages,
)
from gradequiv.models import BatchConfig, InvalidArgument

pytestmark = pytest.mark.distributed

# four rows: two micro-batches of two, or four of one; dropout on at every site; untied
CASE = replace(find_case("4L-group2-dropout-untied"), batch=BatchConfig(4, 8, padding=False))
PADDED = replace(CASE, batch=BatchConfig(4, 8, padding=True))
CALM = replace(CASE, model=replace(CASE.model, embd_dropout=0.0, attn_dropout=0.0,
                                   resid_dropout=0.0, mlp_dropout=0.0))
PATHS = {"full": None, "torch": {}, "no-rng-restore": {"preserve_rng_state": False}}


def _pipelining(schedule: str) -> Pipelining:
    """Two micro-batches where one stage sits on each rank, four where two do."""
    return Pipelining(schedule, 2 if PIPELINE_SCHEDULES[schedule].stages_per_rank == 1 else 4)


def _rank(rank: int, folder: str) -> None:
    import torch.distributed as dist

    from gradequiv.harness import resolve
    from gradequiv.harness.engine.pipeline import StagedPath

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=2)
    device = torch.device("cpu")
    seen: dict[Any, Any] = {}
    for label, case in (("", CASE), ("padded", PADDED), ("calm", CALM)):
        for schedule in PIPELINE_SCHEDULES:
            for name, kwargs in PATHS.items():
                if label == "calm" and name != "full":
                    continue
                impl = None if kwargs is None else resolve("torch", kwargs=kwargs)
                path = prepare(case, impl, device, seed_offset=rank)
                staged = StagedPath(path, _pipelining(schedule), rank, 2)
                seen[label, schedule, name] = [staged.step() for _ in range(case.steps)]
    torch.save(seen, Path(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_saw() -> list[dict[Any, Any]]:
    """What each of two ranks saw, by (case label, schedule, path)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(folder,), nprocs=2)
        return [torch.load(Path(folder, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def _differences(a: list[Any], b: list[Any]) -> list[str]:
    """Where two runs of the same steps part: losses and gradients, by step and name."""
    found = []
    for step, (x, y) in enumerate(zip(a, b, strict=True), start=1):
        assert x.stages == y.stages and sorted(x.grads) == sorted(y.grads)
        assert len(x.losses) == len(y.losses)
        found += [f"step {step} loss {k}" for k, (p, q) in enumerate(zip(x.losses, y.losses))
                  if not torch.equal(p, q)]
        found += [f"step {step} grad of {n}" for n in sorted(x.grads)
                  if not torch.equal(x.grads[n], y.grads[n])]
    return found


@pytest.mark.parametrize("label", ["", "padded"])
@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
def test_torch_checkpoint_is_bitwise_full_storage_under_the_schedule(
        ranks_saw: list[dict[Any, Any]], schedule: str, label: str) -> None:
    for rank, seen in enumerate(ranks_saw):
        full, checkpointed = seen[label, schedule, "full"], seen[label, schedule, "torch"]
        assert _differences(full, checkpointed) == [], f"rank {rank}"
        assert all(g is not None for g in full[0].grads.values()), f"rank {rank}"
    # every parameter has its gradient on exactly one rank; the losses on the last stage's
    names = [set(seen[label, schedule, "full"][0].grads) for seen in ranks_saw]
    whole = {name for name, _ in prepare(CASE, None, torch.device("cpu")).model.named_parameters()}
    assert not names[0] & names[1] and names[0] | names[1] == whole
    losses = [len(seen[label, schedule, "full"][0].losses) for seen in ranks_saw]
    assert sorted(losses) == [0, _pipelining(schedule).micro_batches]


def test_without_rng_restoration_the_masks_differ_under_every_schedule(
        ranks_saw: list[dict[Any, Any]]) -> None:
    for schedule in PIPELINE_SCHEDULES:
        parted = [_differences(seen["", schedule, "full"], seen["", schedule, "no-rng-restore"])
                  for seen in ranks_saw]
        assert any(parted), schedule


def test_without_dropout_the_split_trains_the_model_as_one_process_does(
        ranks_saw: list[dict[Any, Any]]) -> None:
    """The stages compute what the whole model does: the micro-batches' mean loss through
    the model in one process gives the same gradients, up to rounding (the schedule sums the
    micro-batches' gradients in another order)."""
    torch.set_num_threads(1)  # tiny tensors: a second thread only waits for a busy core
    for schedule in PIPELINE_SCHEDULES:
        path = prepare(CALM, None, torch.device("cpu"))
        n = _pipelining(schedule).micro_batches
        for batch in path.micro_batches() if n == 1 else _split(path, n):
            (path.forward(batch=batch)[1] / n).backward()
        whole = dict(path.model.named_parameters())
        for seen in ranks_saw:
            for name, grad in seen["calm", schedule, "full"][0].grads.items():
                torch.testing.assert_close(grad, whole[name].grad, msg=f"{schedule}: {name}")


def _split(path: Any, n: int) -> list[Any]:
    from gradequiv.harness.engine.path import micro_batches

    return micro_batches(path.inputs, path.targets, n)


@pytest.mark.parametrize(("change", "names"), [
    ({"tie_embeddings": True}, "tie_embeddings=true"),
    ({"running_stats": True}, "running_stats=true"),
    ({"aux_loss": True}, "aux_loss=true"),
    ({"outside_params": True}, "outside_params=true"),
    ({"frozen_first_layer": True}, "frozen_first_layer=true"),
])
def test_what_a_split_by_layers_cannot_carry_is_refused_by_name(
        change: dict[str, Any], names: str) -> None:
    case = replace(CASE, model=replace(CASE.model, **change))
    why = pipeline_refusal(case)
    assert why is not None and why.startswith(names)
    with pytest.raises(InvalidArgument, match=names):
        split_stages(prepare(case, None, torch.device("cpu")), 2)


def test_layouts_that_do_not_fit_are_refused_before_any_rank_starts() -> None:
    assert pipeline_refusal(CASE, Pipelining("gpipe", 2)) is None
    # group:2 over 4 layers: embeddings, two groups, head; 6 stages on 3 ranks do not fit
    too_many = pipeline_refusal(CASE, Pipelining("interleaved-1f1b", 4), world_size=3)
    assert too_many is not None and "6 stages" in too_many
    assert "micro_batches >= 4" in (pipeline_refusal(CASE, Pipelining("dualpipev", 2)) or "")
    assert "micro_batches >= 2" in (pipeline_refusal(CASE, Pipelining("1f1b", 1)) or "")
    assert "batch_size=4" in (pipeline_refusal(CASE, Pipelining("gpipe", 8)) or "")
    shared = replace(CASE, model=replace(CASE.model, layer_repeats=2))
    assert pipeline_refusal(shared, Pipelining("gpipe", 2)) is None
    assert "weight pass" in (pipeline_refusal(shared, Pipelining("zbv-zero-bubble", 4)) or "")
    with pytest.raises(InvalidArgument, match="exactly two stages per rank"):
        Pipelining("zbv-zero-bubble", 4, stages_per_rank=3)


def test_stages_hold_the_models_own_modules_in_call_order() -> None:
    path = prepare(CASE, None, torch.device("cpu"))
    stages = split_stages(path, 4)
    model_params = {id(p) for p in path.model.parameters()}
    held = [id(p) for s in stages for p in s.parameters()]
    assert sorted(held) == sorted(model_params)  # each parameter once, the model's own
    assert [len(s.layers) for s in stages] == [0, 1, 1, 0]  # embeddings, group, group, head
    assert stages[0].embeddings is not None and stages[-1].head is not None


# -- through the check's own engine on the ranks (gradequiv distributed --wrapper pp) --------

def _through_check(impl: str, schedules: list[str], case: Any = CASE) -> dict[str, Any]:
    """Each schedule's verdict on ``case``, as ``gradequiv distributed`` gets it from its
    ranks."""
    from gradequiv.harness import resolve
    from gradequiv.harness.commands.distributed import RankPool
    from gradequiv.harness.engine.parallel import Parallel

    with RankPool(resolve(impl), world_size=2, timeout_s=120) as pool:
        return {s: pool.run(case, Parallel("pp", pipeline=_pipelining(s))) for s in schedules}


def test_the_check_passes_torch_checkpoint_under_every_schedule_with_every_property() -> None:
    """Every property ``check`` has, on every rank, read from torch's schedule: the loss and
    the logits from the last stage, each gradient from its stage's rank, the segments'
    re-runs counted over the ranks (the zero-bubble weight pass asks autograd once per group
    of parameters, and each such pass may re-run a segment once)."""
    verdicts = _through_check("torch", list(PIPELINE_SCHEDULES))
    for schedule, verdict in verdicts.items():
        assert verdict.passed, (schedule, verdict.error, verdict.failures)
        for rank in verdict.verdicts:
            checked = {p.name for p in rank.properties if p.passed}
            assert {"outputs", "gradients", "trajectory", "recompute"} <= checked, schedule


def _locus(verdict: Any) -> tuple[int, int, int, str]:
    """Where a failing pipeline case says the two paths first part: (stage, its rank,
    micro-batch, what), and that its first line says so."""
    locus = verdict.locus
    assert locus is not None, verdict.first_failure
    said = f"first differs at stage {locus['stage']} (rank {locus['rank']}), micro-batch "
    assert said + str(locus["micro_batch"]) in verdict.first_failure
    return locus["stage"], locus["rank"], locus["micro_batch"], locus["what"]


def test_a_stash_per_module_fails_under_the_schedules_and_one_per_call_passes() -> None:
    """The slot holds the latest micro-batch's inputs when the first one's backward re-runs.
    GPipe runs every forward first: the last stage's (1, on rank 1) re-run of micro-batch 0
    reads micro-batch 1's, and the gradient it hands back is the first to differ. 1F1B runs
    the last stage's backward of micro-batch 0 before its next forward (right there), and
    the first stage's after both forwards: its weights' gradients at micro-batch 0. ZBV's V
    puts stages 1 and 2 (the two groups) on rank 1: stage 2, the later one, re-runs
    micro-batch 0 after later micro-batches' forwards filled its slot."""
    schedules = ["gpipe", "1f1b", "zbv-zero-bubble"]
    wrong = _through_check("pipeline_impls:module_slot_checkpoint", schedules)
    right = _through_check("correct_impls:call_keyed_stash_checkpoint", schedules)
    for schedule in schedules:
        assert not wrong[schedule].passed and wrong[schedule].error is None, schedule
        assert "gradients: grad of blocks." in wrong[schedule].failures[0], schedule
        assert right[schedule].passed, (schedule, right[schedule].failures)
        assert right[schedule].locus is None
    assert _locus(wrong["gpipe"]) == (1, 1, 0, "input gradient")
    assert _locus(wrong["1f1b"]) == (0, 0, 0, "weight gradients")
    assert _locus(wrong["zbv-zero-bubble"]) == (2, 1, 0, "input gradient")


def test_torch_reentrant_checkpoint_is_refused_by_the_stage_loudly_and_ends_the_case() -> None:
    """torch's stage runs backward with ``inputs=``, which torch's reentrant checkpoint
    refuses: the rank that raises ends the case at once with its traceback (its peers would
    wait on its sends for ever), not after the timeout."""
    import time

    started = time.monotonic()
    verdict = _through_check("torch-reentrant", ["gpipe"])["gpipe"]
    assert not verdict.passed and verdict.error is not None
    assert "the recompute path raised on rank" in verdict.error
    assert "use_reentrant=False" in verdict.error
    assert time.monotonic() - started < 60


def test_a_drawn_pipeline_run_names_the_cause_and_replays_the_schedule(
        capsys: pytest.CaptureFixture[str]) -> None:
    from gradequiv.harness.cli import main

    assert main(["distributed", "--impl", "torch", "--wrapper", "pp", "--examples", "4",
                 "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert out.count("pp (Schedule1F1B") == 4 and out.endswith("verdict: pass\n")
    assert main(["distributed", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 "--wrapper", "pp", "--examples", "8", "--seed", "3"]) == 1
    out = capsys.readouterr().out
    cause = out.split("likely cause: ")[1].splitlines()[0]
    assert cause.startswith("the recompute does not restore the RNG state")
    assert "--wrapper pp --schedule " in out.split("reproduce: ")[1]


def test_a_stash_freed_by_the_first_backward_fails_only_where_the_weight_pass_is_a_second(
        ) -> None:
    """Zero bubble splits each micro-batch's backward into an input pass and weight passes
    over the same graph: a checkpoint that lets go of its saved inputs in the first backward
    through a call is right under GPipe and 1F1B, and raises under both zero-bubble
    schedules, where the case ends with that rank's traceback."""
    verdicts = _through_check("pipeline_impls:frees_after_first_pass",
                              ["gpipe", "1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"])
    assert verdicts["gpipe"].passed and verdicts["1f1b"].passed
    for schedule in ("interleaved-zero-bubble", "zbv-zero-bubble"):
        error = verdicts[schedule].error or ""
        assert "freed by an earlier backward pass" in error, schedule
    # the first weight pass over a checkpointed stage: stage 2 holds a group (stage 1's
    # input pass and weight pass come later, stage 3 is the head), micro-batch 0; stage 2
    # sits on rank 0 in a loop, on rank 1 in the V
    for schedule, rank in (("interleaved-zero-bubble", 0), ("zbv-zero-bubble", 1)):
        said = f"raised at stage 2 (rank {rank}), micro-batch 0, in its weight pass"
        assert verdicts[schedule].first_failure.endswith(said), schedule


def _each(runs: list[tuple[str, Any, Pipelining]]) -> list[Any]:
    """Each (implementation, case, layout)'s verdict under ``gradequiv distributed --wrapper
    pp``, from one pool of two ranks."""
    from gradequiv.harness import resolve
    from gradequiv.harness.commands.distributed import RankPool
    from gradequiv.harness.engine.parallel import Parallel

    with RankPool(resolve("torch"), world_size=2, timeout_s=120) as pool:
        return [pool.run(case, Parallel("pp", pipeline=layout), impl=resolve(impl))
                for impl, case, layout in runs]


def _fails_on_both_ranks(verdict: Any, says: str) -> None:
    assert not verdict.passed and verdict.error is None, verdict.error
    assert len(verdict.failures) == 2
    for rank, line in enumerate(verdict.failures):
        assert line.startswith(f"rank {rank}: {says}"), line


def test_a_stack_of_boundaries_per_stage_fails_once_micro_batches_are_in_flight() -> None:
    """One stack per process, popped from the top: torch's GPipe and 1F1B run micro-batch
    0's backward first and re-run it with micro-batch 1's inputs and masks; with one
    micro-batch it is right, and in one process where backward runs the latest micro-batch
    first it is right too, where the slot per module is not (another fault)."""
    from gradequiv.harness import resolve
    from gradequiv.harness.engine.verify import verify

    stack = "pipeline_impls:stage_stack_checkpoint"
    gpipe, one_f_one_b, alone = _each([(stack, CASE, Pipelining("gpipe", 2)),
                                       (stack, CASE, Pipelining("1f1b", 2)),
                                       (stack, CASE, Pipelining("gpipe", 1))])
    for verdict in (gpipe, one_f_one_b):
        _fails_on_both_ranks(verdict, "gradients: grad of blocks.0.norm_2.weight: relative "
                                      "error 1.2")
    # micro-batch 0's re-run pops micro-batch 1's boundary: under GPipe the last stage's
    # first (all forwards ran), under 1F1B the first stage's (the last stage's backward of
    # micro-batch 0 runs before its next forward, and pops its own)
    assert _locus(gpipe) == (1, 1, 0, "input gradient")
    assert _locus(one_f_one_b) == (0, 0, 0, "weight gradients")
    assert alone.passed, alone.failures
    torch.set_num_threads(1)
    reverse = replace(CASE, schedule="gpipe-reverse")
    assert verify(resolve(stack), reverse).passed
    assert not verify(resolve("pipeline_impls:module_slot_checkpoint"), reverse).passed


def test_a_re_run_under_backwards_autocast_fails_where_the_schedule_runs_backward_outside(
        ) -> None:
    """A stage enters the case's bf16 autocast in its forward; torch's schedule runs every
    backward outside it, so a checkpoint that re-runs under the autocast of the moment
    re-runs in fp32. The same checkpoint is right in one process whose backward runs inside
    the forward's autocast block, and under the schedule without autocast; torch's
    checkpoint passes the bf16 case under the schedule."""
    from gradequiv.harness import resolve
    from gradequiv.harness.engine.verify import verify

    mutant = "pipeline_impls:autocast_read_at_rerun"
    bf16 = replace(CASE, dtype="bf16-autocast")
    *wrong, fp32, torch_own = _each([(mutant, bf16, Pipelining("gpipe", 2)),
                                     (mutant, bf16, Pipelining("1f1b", 2)),
                                     (mutant, CASE, Pipelining("1f1b", 2)),
                                     ("torch", bf16, Pipelining("1f1b", 2))])
    for verdict in wrong:
        _fails_on_both_ranks(verdict, "gradients: grad of blocks.1.mlp.fc.weight: relative "
                                      "error 0.0")
        # every re-run is in fp32: the last stage's, of micro-batch 0, is the first backward
        assert _locus(verdict) == (1, 1, 0, "input gradient")
    assert fp32.passed, fp32.failures
    assert torch_own.passed, torch_own.failures
    torch.set_num_threads(1)
    assert verify(resolve(mutant), replace(bf16, backward_autocast=True)).passed


def test_per_call_peers_pass_under_every_schedule_zero_bubble_included() -> None:
    """A stash keyed per call and a saved-tensor-hooks checkpoint that re-runs once per
    backward pass: zero bubble's input pass and its weight passes each find what they need,
    the hooks' one under bf16 autocast too."""
    peers = ["correct_impls:call_keyed_stash_checkpoint", "correct_impls:graph_task_checkpoint"]
    schedules = ["gpipe", "1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"]
    runs = [(peer, CASE, _pipelining(s)) for peer in peers for s in schedules]
    runs.append((peers[1], replace(CASE, dtype="bf16-autocast"), _pipelining(schedules[-1])))
    for run, verdict in zip(runs, _each(runs), strict=True):
        assert verdict.passed, (run, verdict.error, verdict.failures)
        for rank in verdict.verdicts:
            checked = {p.name for p in rank.properties if p.passed}
            assert {"gradients", "recompute"} <= checked, run


def test_report_json_says_where_a_pipeline_case_first_parts(tmp_path: Path) -> None:
    """The stage, its rank and the micro-batch go into the failure's message (the first
    line a reader sees) and, as fields, into report.json's minimal failure (validated
    against the schema as the report is read)."""
    from gradequiv.harness.cli import main
    from gradequiv.harness.reports.bundle import load_bundle

    assert main(["distributed", "--impl", "pipeline_impls:stage_stack_checkpoint",
                 "--wrapper", "pp", "--schedule", "gpipe", "--micro-batches", "2",
                 "--case", CASE.to_json(), "--report-dir", str(tmp_path)]) == 1
    report = load_bundle(tmp_path).report
    assert report["minimal_failures"][0]["pipeline"] == {
        "stage": 1, "rank": 1, "micro_batch": 0, "step": 1, "what": "input gradient"}
    assert report["failure"]["message"].endswith(
        "first differs at stage 1 (rank 1), micro-batch 0: the gradient it hands back for "
        "its input (step 1)")


# -- PP x DP: FSDP2 per stage, 2 stages x 2 data-parallel ranks -------------------------------

#: four rows: each data-parallel rank its two, as two micro-batches of one
PP_DP = replace(CASE, batch=BatchConfig(4, 8, padding=False))


def _pp_dp_rank(rank: int, folder: str) -> None:
    """Rank ``rank`` of a (pp=2, dp=2) mesh: its stage sharded over its data-parallel pair,
    its half of the rows, each path trained through GPipe and 1F1B."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gradequiv.harness import resolve
    from gradequiv.harness.engine.pipeline import StagedPath

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    seen: dict[Any, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        for name, kwargs in PATHS.items():
            impl = None if kwargs is None else resolve("torch", kwargs=kwargs)
            path = prepare(PP_DP, impl, torch.device("cpu"), seed_offset=rank)
            path.inputs = (path.inputs[0][2 * dp_rank:2 * dp_rank + 2], None)
            path.targets = path.targets[2 * dp_rank:2 * dp_rank + 2]
            staged = StagedPath(path, Pipelining(schedule, 2), pp_rank, 2,
                                group=mesh["pp"].get_group(), data_parallel=mesh["dp"])
            steps = [staged.step() for _ in range(PP_DP.steps)]
            for step in steps:  # each rank's own shard of each gradient
                step.grads = {n: None if g is None else g.to_local()
                              for n, g in step.grads.items()}
            seen[schedule, name] = steps
    torch.save(seen, Path(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp2_per_stage_under_the_schedule_keeps_torch_checkpoint_bitwise() -> None:
    """PP x DP on four gloo ranks, as torchtitan composes them: the pipeline's two stages
    each FSDP2-sharded over a pair of data-parallel ranks that train their own rows; the
    re-run meets parameters gathered again. torch's checkpoint is bitwise full storage on
    every rank, and without RNG restoration the masks differ on some."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_pp_dp_rank, args=(folder,), nprocs=4)
        ranks = [torch.load(Path(folder, f"rank{r}.pt"), weights_only=False)
                 for r in range(4)]
    for schedule in ("gpipe", "1f1b"):
        for rank, seen in enumerate(ranks):
            full = seen[schedule, "full"]
            assert _differences(full, seen[schedule, "torch"]) == [], (schedule, rank)
            assert all(g is not None for g in full[0].grads.values()), (schedule, rank)
        # the last stage's ranks (pp index 1: ranks 2 and 3) hold the losses of their rows
        assert [len(seen[schedule, "full"][0].losses) for seen in ranks] == [0, 0, 2, 2]
        assert any(_differences(seen[schedule, "full"], seen[schedule, "no-rng-restore"])
                   for seen in ranks), schedule


def test_a_checkpoint_exact_under_1f1b_passes_the_schedule_stated_and_fails_zero_bubble(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Done when (issue 48): a checkpoint whose RNG state the first backward pass through a
    call uses up passes ``distributed --wrapper pp`` stated as 1F1B (in pyproject.toml, as a
    user states it), and fails where the stated schedule is zero bubble, whose weight pass is
    a second backward through the call."""
    from gradequiv.harness.cli import main

    (tmp_path / "pyproject.toml").write_text(
        '[tool.gradequiv]\npipeline-schedules = ["1f1b"]\nmicro-batches = 4\n')
    monkeypatch.chdir(tmp_path)
    run = ["distributed", "--impl", "regime_impls:one_pass_checkpoint", "--wrapper", "pp",
           "--examples", "4"]
    assert main(run) == 0, capfd.readouterr().out
    out = capfd.readouterr().out
    assert "Schedule1F1B, 4 micro-batches" in out and "ScheduleGPipe" not in out
    assert main([*run, "--regime", "pipeline-schedules=zbv-zero-bubble"]) == 1
    out = capfd.readouterr().out
    assert "minimal failure" in out and "ScheduleZBVZeroBubble" in out

