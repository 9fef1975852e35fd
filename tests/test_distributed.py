"""Recompute under DDP, FSDP2 and tensor parallelism on two gloo ranks: equal where it should
be, caught where not. Each start of ranks costs seconds: the drawn runs and the engines one by
one are marked ``distributed`` (``-m distributed``, in .ci/run); the default suite keeps one
case under every engine and the refusals."""

from __future__ import annotations

import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradequiv.harness import find_case, resolve
from gradequiv.harness.cli import main
from gradequiv.harness.commands.distributed import RankPool, verify_distributed
from gradequiv.harness.engine.parallel import Parallel
from gradequiv.models import InvalidArgument

CASE = find_case("4L-group2-dropout-untied")  # batch 2: one sample per rank, dropout on
NO_RNG_RESTORE = resolve("torch", kwargs={"preserve_rng_state": False})


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """Two ranks for the module's cases, started once, as a run starts them."""
    with RankPool(resolve("torch"), world_size=2) as pool:
        yield pool


@pytest.mark.slow
def test_torch_checkpoint_matches_full_storage_under_every_engine(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["distributed", "--impl", "torch", "--case", CASE.name]) == 0
    out = capsys.readouterr().out
    # ddp, fsdp, tp: each rank checks what check checks (gradients, weights, buffers, RNG)
    assert out.count("  pass: 210 tensors equal on every rank") == 3
    assert "under tp (DTensor: MLPs column- then row-wise)" in out


@pytest.mark.distributed
def test_drawn_cases_pass_on_two_ranks_under_every_engine_and_reshard_mode(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Drawn as check draws them (dtypes, granularities, dropout, the model's knobs), each
    under DDP, FSDP2 (every reshard mode, with and without its bf16 policy), tensor and
    sequence parallelism or torch's pipeline schedules, the ranks started once for the run."""
    assert main(["distributed", "--impl", "torch", "--examples", "10", "--seed", "10"]) == 0
    out = capsys.readouterr().out
    assert "10 case(s) verified on every rank" in out and out.endswith("verdict: pass\n")
    assert ", ddp: pass" in out and ", tp (DTensor: MLPs column- then row-wise): pass" in out
    assert "sequence-parallel norms): pass" in out
    assert "fsdp (reshard_after_forward=2, bf16 parameters, fp32 reduce): pass" in out
    assert "pp (ScheduleLoopedBFS, 4 micro-batches, 2 stage(s) per rank): pass" in out
    assert "not checked" not in out


@pytest.mark.distributed
def test_a_drawn_failure_is_shrunk_with_its_cause_and_a_line_that_replays_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["distributed", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 "--examples", "8"])
    out = capsys.readouterr().out
    assert code == 1 and out.endswith("verdict: FAIL\n")
    assert "likely cause: the recompute does not restore the RNG state" in out
    reproduce = out.split("reproduce: ")[1].splitlines()[0]
    assert reproduce.startswith("gradequiv distributed --impl torch --impl-kwarg "
                                "preserve_rng_state=false --world-size 2 --wrapper ddp --case")
    assert main(shlex.split(reproduce)[1:]) == 1
    assert "  FAIL: rank 0: gradients: grad of" in capsys.readouterr().out


@pytest.mark.distributed
def test_a_users_model_and_parallel_set_up_are_what_the_ranks_train(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the ranks import them
    assert main(["distributed", "--impl", "torch", "--examples", "2", "--model",
                 "user_models:residual_stack"]) == 0
    assert "model user_models:residual_stack" in capsys.readouterr().out
    assert main(["distributed", "--impl", "torch", "--examples", "2", "--parallelize",
                 "parallel_setups:fsdp_per_block"]) == 0
    assert ", user: pass" in capsys.readouterr().out
    # both: their model under their set-up, handed their own module (not the harness's
    # wrapper), here one that returns a DDP wrapper the ranks then call
    for setup in ("fsdp_per_block", "ddp_wrapped"):
        assert main(["distributed", "--impl", "torch", "--examples", "2", "--model",
                     "user_models:residual_stack", "--parallelize",
                     f"parallel_setups:{setup}"]) == 0
        assert "2 case(s) verified on every rank" in capsys.readouterr().out
    assert main(["distributed", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 "--examples", "4", "--model", "user_models:residual_stack", "--parallelize",
                 "parallel_setups:ddp_wrapped"]) == 1
    out = capsys.readouterr().out
    assert "likely cause: the recompute does not restore the RNG state" in out
    assert "--wrapper user --parallelize parallel_setups:ddp_wrapped --case" in out
    assert main(["distributed", "--impl", "torch", "--parallelize",
                 "parallel_setups:NOT_A_FUNCTION"]) == 2
    assert "--parallelize='parallel_setups:NOT_A_FUNCTION' is a int, not a function" in \
        capsys.readouterr().err


@pytest.mark.distributed
def test_fsdp_keeping_its_parameters_gathered_is_checked_too() -> None:
    verdict = verify_distributed(resolve("torch"), CASE, wrapper="fsdp",
                                 reshard_after_forward=False)
    assert verdict.passed and verdict.wrapper == "fsdp (reshard_after_forward=False)"


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [
    Parallel("fsdp", reshard_after_forward=False),  # the re-run meets gathered parameters
    Parallel("tp"),  # dropout in the sharded MLP draws from torch's distributed RNG
    Parallel("fsdp", mixed_precision=True),  # the re-run computes in bf16 too
    Parallel("tp", sequence_parallel=True),  # the re-run gathers and scatters the sequence
], ids=["fsdp-keep-gathered", "tp", "fsdp-bf16", "tp-sequence"])
def test_every_engine_passes_and_catches_a_lost_rng(ranks: RankPool, parallel: Parallel) -> None:
    assert ranks.run(CASE, parallel).passed
    broken = ranks.run(CASE, parallel, impl=NO_RNG_RESTORE)
    assert not broken.passed and broken.error is None
    assert {line.split(":")[0] for line in broken.failures} == {"rank 0", "rank 1"}


@pytest.mark.distributed
def test_sequence_parallelism_hands_a_segment_its_part_of_the_sequence(ranks: RankPool) -> None:
    """Under sequence parallelism an MLP segment's input is a DTensor (each rank's part of
    the sequence): its gradient is gathered whole and compared as any other, on a pre-norm
    case with RMSNorm and SwiGLU; without RNG restoration the re-run's masks differ."""
    case = find_case("2L-mlp-swiglu-rmsnorm")
    parallel = Parallel("tp", sequence_parallel=True)
    verdict = ranks.run(case, parallel)
    assert verdict.passed, verdict.failures
    gradients = next(p for p in verdict.verdicts[0].properties if p.name == "gradients")
    assert {"grad of input blocks.0.mlp:h", "grad of input blocks.1.mlp:h",
            "grad of blocks.0.norm_2.weight"} <= {c.name for c in gradients.checks}
    assert not ranks.run(case, parallel, impl=NO_RNG_RESTORE).passed


def test_no_rng_restore_is_caught_on_every_rank(ranks: RankPool) -> None:
    verdict = ranks.run(CASE, Parallel("ddp"), impl=NO_RNG_RESTORE)
    assert not verdict.passed and verdict.error is None
    assert {line.split(":")[0] for line in verdict.failures} == {"rank 0", "rank 1"}
    for rank in verdict.verdicts:  # each rank's verdict, as check gives one: the reduced
        # gradients differ down to the embedding, below every re-run segment
        gradients = next(p for p in rank.properties if p.name == "gradients")
        assert "grad of wte.weight" in {c.name for c in gradients.checks if not c.passed}


@pytest.mark.distributed
def test_a_hanging_rank_is_killed_and_fails_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # ranks import wrong_impls
    started = time.monotonic()
    verdict = verify_distributed(resolve("wrong_impls:hangs"), CASE, timeout_s=15)
    assert not verdict.passed and "did not finish within 15 s" in (verdict.error or "")
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("kwargs, message", [
    ({"wrapper": "zero3"}, "wrapper='zero3' is not one of ddp, fsdp, tp, fsdp-tp, pp, user"),
    ({"wrapper": "ddp", "mixed_precision": True}, "the policy is FSDP2's"),
    ({"world_size": 1}, "world_size=1: data parallelism needs at least 2"),
    ({"world_size": 3}, "batch_size=2 < world_size=3"),
    ({"device": "tpu"}, "device='tpu' is not one of cpu, cuda"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        verify_distributed(resolve("torch"), CASE, **kwargs)


def test_a_training_loop_it_does_not_drive_is_refused() -> None:
    """It trains one forward and one backward per step: a schedule is never run silently
    as something else."""
    from dataclasses import replace

    with pytest.raises(InvalidArgument, match="gpipe: the distributed property"):
        verify_distributed(resolve("torch"), replace(CASE, schedule="gpipe",
                                                     batch=replace(CASE.batch, batch_size=4)))


def test_nccl_needs_one_gpu_per_rank() -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs: the NCCL path runs in ci/gpu-check.sh")
    with pytest.raises(InvalidArgument, match="needs 2 GPUs for NCCL"):
        verify_distributed(resolve("torch"), CASE, device="cuda")


@pytest.mark.slow
def test_a_run_writes_report_json_as_check_does_with_each_ranks_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One author: report.json validates against check's schema, its verdict decided the same
    way, each case with every rank's verdict and memory; report.md beside it; a gate reads it."""
    from gradequiv.harness.reports.bundle import load_bundle

    passing, failing = tmp_path / "pass", tmp_path / "fail"
    assert main(["distributed", "--impl", "torch", "--case", CASE.name, "--wrapper", "fsdp",
                 "--report-dir", str(passing)]) == 0
    assert "held for backward (recompute of full storage, bytes): rank 0 " in \
        capsys.readouterr().out
    report = load_bundle(passing).report  # validated against the schema
    assert report["command"] == "distributed" and report["verdict"] == "pass"
    [record] = report["cases"]
    assert record["engine"] == {"engine": "fsdp", "reshard_after_forward": True,
                                "mixed_precision": False, "model_parallel": False,
                                "sequence_parallel": False, "pipeline": None,
                                "world_size": 2}
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    assert all(r["held_bytes"]["recompute"] < r["held_bytes"]["full"] for r in record["ranks"])
    assert main(["report", str(passing), "--fail-on-verdict"]) == 0

    assert main(["distributed", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 "--case", CASE.name, "--wrapper", "ddp", "--report-dir", str(failing)]) == 1
    report = load_bundle(failing).report
    assert report["verdict"] == "fail" and report["complete"] is True
    assert report["failure"]["diagnosis"]["sentence"].startswith(
        "the recompute does not restore the RNG state")
    assert report["failure"]["reproduce"].startswith("gradequiv distributed --impl torch")
    assert (failing / "report.md").read_text().startswith("## gradequiv: FAIL")
    capsys.readouterr()
    assert main(["report", str(failing), "--fail-on-verdict"]) == 1


def test_a_case_the_engine_cannot_train_is_no_verdict_on_the_implementation(
        ranks: RankPool) -> None:
    """Full storage itself fails under tensor parallelism (in-place ops on the sharded MLP's
    output, a DTensor's local view): not checked, said as the model's fault under the
    engine, never a failure of the recompute; drawn cases leave such set-ups out."""
    from dataclasses import replace

    from hypothesis import given, settings

    from gradequiv.properties.strategies import distributed_cases

    in_place = replace(CASE, model=replace(CASE.model, inplace_ops=True))
    verdict = ranks.run(in_place, Parallel("tp"))
    assert not verdict.passed and verdict.verdicts == [] and verdict.error is None
    assert verdict.first_failure.startswith("not checked: the full-storage path of case")
    assert "a fault of the model under this engine, not of the implementation" in \
        verdict.first_failure

    @settings(max_examples=60, database=None, deadline=None)
    @given(distributed_cases(engines=("tp",)))
    def drawn(case_and_engine: tuple) -> None:
        assert not case_and_engine[0].model.inplace_ops

    drawn()

    @settings(max_examples=60, database=None, deadline=None)  # the bf16 policy is the case's
    @given(distributed_cases(engines=("fsdp",)))  # precision: no autocast or cast beside it
    def sharded(case_and_engine: tuple) -> None:
        case, parallel = case_and_engine
        assert case.dtype == "fp32" or not parallel.mixed_precision

    sharded()


@pytest.mark.distributed
def test_a_megatron_style_tracker_checkpoint_on_ranks_restores_both_generators_or_is_named(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's shape (tests/tracker_setups.py) on two ranks: the checkpoint that restores
    the default generator and the tracker's states passes; the one that restores only the
    default generator fails, the tracker's state named where it lives."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    model = ["--model", "tracker_setups:tracker_stack", "--wrapper", "ddp", "--examples", "3"]
    assert main(["distributed", "--impl", "tracker_setups:tracker_checkpoint", *model]) == 0
    capsys.readouterr()
    assert main(["distributed", "--impl", "tracker_setups:default_only_checkpoint",
                 *model]) == 1
    assert ("likely cause: the recompute does not restore the RNG state of "
            "tracker_setups.TRACKER.states_['model-parallel-rng']") in capsys.readouterr().out


def test_under_a_bf16_policy_a_reordered_sum_may_round_in_bf16_and_no_more() -> None:
    """FSDP2's bf16 parameters over fp32 shards: a gradient summed in another order (a
    reentrant re-run) is one bf16 step off, not a fault; elsewhere fp32's slack holds."""
    import torch

    from gradequiv.harness.engine.compare import Tolerance, reorder_slack
    from gradequiv.harness.engine.parallel import RankSetup

    policy = RankSetup(Parallel("fsdp", mixed_precision=True), 0, 2).compute_dtype
    assert Tolerance("fp32", compute=policy).bound(0.0, torch.float32) == \
        reorder_slack(torch.bfloat16)
    assert RankSetup(Parallel("fsdp"), 0, 2).compute_dtype is None
    assert Tolerance("fp32").bound(0.0, torch.float32) == reorder_slack(torch.float32)


@pytest.mark.distributed
def test_a_2d_mesh_of_four_ranks_fsdp_over_tensor_parallel_pairs() -> None:
    """torchtitan's FSDP x TP: tensor parallel in pairs of ranks (the same rows and masks),
    FSDP2 across the pairs (their own rows); 2-D sharded weights gathered whole."""
    from dataclasses import replace

    four = replace(CASE, name="", batch=replace(CASE.batch, batch_size=4))
    with RankPool(resolve("torch"), world_size=4) as pool:
        verdict = pool.run(four, Parallel("fsdp-tp"))
        assert verdict.passed and len(verdict.verdicts) == 4
        broken = pool.run(four, Parallel("fsdp-tp", mixed_precision=True), impl=NO_RNG_RESTORE)
    assert not broken.passed and broken.error is None
    assert {line.split(":")[0] for line in broken.failures} == {f"rank {r}" for r in range(4)}


@pytest.mark.distributed
def test_world_sizes_are_drawn_and_a_failure_shrinks_towards_the_fewest_ranks(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["distributed", "--impl", "torch", "--world-size", "4", "--examples", "6",
                 "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "on 2 to 4 ranks" in out and " on 4 ranks: pass" in out and " on 2 ranks: pass" in out
    assert main(["distributed", "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false",
                 "--world-size", "4", "--examples", "6", "--seed", "1"]) == 1
    out = capsys.readouterr().out
    assert " on 2 ranks\n" in out.split("minimal failure: ")[1].splitlines()[0] + "\n"
    assert "--world-size 2 --wrapper" in out.split("reproduce: ")[1]


@pytest.mark.distributed
@pytest.mark.parametrize("spec", ["deepspeed-partitioned", "deepspeed-partitioned-cpu"])
def test_deepspeed_partitioned_activations_over_a_model_parallel_group_of_two(
        spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's own checkpoint with ``partition_activations`` (each rank keeps half of
    every saved input, all-gathered in backward; on the host too with ``cpu_checkpointing``)
    over a model-parallel group of both ranks, on a user's model whose set-up gives every
    rank the same rows: it passes every property, memory included, on both ranks, though it
    swaps the storage of each checkpointed input (the caller's input too) for its part in
    forward and for the gathered whole in backward. Over ranks that train other rows
    (nothing of the same input to gather) it fails."""
    pytest.importorskip("deepspeed")
    from gradequiv.harness.engine.case import Case
    from gradequiv.models import ExternalConfig

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    case = Case(model=ExternalConfig("user_models:residual_stack"), dtype="fp32")
    with RankPool(resolve(spec), world_size=2,
                  parallelize="parallel_setups:replicated") as pool:
        verdicts = [pool.run(case, Parallel("user", model_parallel=True)) for _ in range(3)]
        broken = pool.run(case, Parallel("user"))  # ranks of other rows: nothing to gather
    for verdict in verdicts:
        assert verdict.error is None and verdict.unrunnable is None
        assert len(verdict.verdicts) == 2 and verdict.compared > 0
        assert verdict.passed, [p.failures for v in verdict.verdicts for p in v.properties]
    assert not broken.passed
    gradients = [next(p for p in rank.properties if p.name == "gradients")
                 for rank in broken.verdicts]
    assert any(c.name.startswith("grad of blocks.") and not c.passed
               for g in gradients for c in g.checks)
