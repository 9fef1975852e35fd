"""Recompute under DDP and FSDP on two gloo ranks: equal where it should be, caught where not."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest

from gradequiv.harness import find_case, resolve
from gradequiv.harness.cli import main
from gradequiv.harness.commands.distributed import verify_distributed
from gradequiv.models import InvalidArgument

CASE = find_case("4L-group2-dropout-untied")  # batch 2: one sample per rank, dropout on


def test_torch_checkpoint_matches_full_storage_under_ddp_and_fsdp(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["distributed", "--impl", "torch", "--case", CASE.name]) == 0
    out = capsys.readouterr().out
    assert out.count("  pass: 196 tensors equal on every rank") == 2  # ddp, then fsdp


def test_drawn_cases_pass_on_two_ranks_under_both_engines_and_reshard_modes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Drawn as check draws them (dtypes, granularities, dropout, the model's knobs), each
    under DDP or FSDP2 with either reshard mode, the ranks started once for the run."""
    assert main(["distributed", "--impl", "torch", "--examples", "8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "8 case(s) verified on every rank" in out and out.endswith("verdict: pass\n")
    assert ", ddp: pass" in out and "fsdp (reshard_after_forward=False): pass" in out


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
    assert "  FAIL: rank 0: step 1 grad of" in capsys.readouterr().out


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
    assert main(["distributed", "--impl", "torch", "--parallelize",
                 "parallel_setups:NOT_A_FUNCTION"]) == 2
    assert "--parallelize='parallel_setups:NOT_A_FUNCTION' is a int, not a function" in \
        capsys.readouterr().err


def test_fsdp_keeping_its_parameters_gathered_is_checked_too() -> None:
    verdict = verify_distributed(resolve("torch"), CASE, wrapper="fsdp",
                                 reshard_after_forward=False)
    assert verdict.passed and verdict.wrapper == "fsdp (reshard_after_forward=False)"
    broken = verify_distributed(resolve("torch", kwargs={"preserve_rng_state": False}), CASE,
                                wrapper="fsdp", reshard_after_forward=False)
    assert not broken.passed


def test_no_rng_restore_is_caught_on_every_rank() -> None:
    verdict = verify_distributed(resolve("torch", kwargs={"preserve_rng_state": False}), CASE,
                                 wrapper="ddp")
    assert not verdict.passed and verdict.error is None
    ranks = {line.split(":")[0] for line in verdict.failures}
    assert ranks == {"rank 0", "rank 1"}
    assert any("grad of wte.weight" in line for line in verdict.failures)


def test_a_hanging_rank_is_killed_and_fails_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # ranks import wrong_impls
    started = time.monotonic()
    verdict = verify_distributed(resolve("wrong_impls:hangs"), CASE, timeout_s=15)
    assert not verdict.passed and "did not finish within 15 s" in (verdict.error or "")
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("kwargs, message", [
    ({"wrapper": "zero3"}, "wrapper='zero3' is not one of ddp, fsdp"),
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
