"""Recompute that goes wrong only across ranks, each fault from a real issue, caught under the
engine where it is wrong and passing where it is right; and the correct peers beside them,
passing under every engine (tests/distributed_impls.py). Two gloo ranks, started once for
the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gradequiv.harness import find_case, resolve
from gradequiv.harness.commands.distributed import DistributedVerdict, RankPool
from gradequiv.harness.engine.parallel import Parallel

pytestmark = pytest.mark.distributed

CASE = find_case("4L-group2-dropout-untied")  # batch 2: one sample per rank, dropout on
ENGINES = {
    "ddp": Parallel("ddp"),
    "fsdp": Parallel("fsdp"),
    "fsdp-keep-gathered": Parallel("fsdp", reshard_after_forward=False),
    "tp": Parallel("tp"),
    "fsdp-bf16": Parallel("fsdp", mixed_precision=True),
}


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """Two ranks for the module's cases; they import the implementations from this folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(Path(__file__).parent))
        with RankPool(resolve("torch"), world_size=2) as pool:
            yield pool


def run(ranks: RankPool, name: str, engine: str) -> DistributedVerdict:
    return ranks.run(CASE, ENGINES[engine], impl=resolve(f"distributed_impls:{name}"))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("peer", ["own_rng_checkpoint", "partitioned_checkpoint"])
def test_correct_peers_pass_under_every_engine(ranks: RankPool, peer: str, engine: str) -> None:
    verdict = run(ranks, peer, engine)
    assert verdict.passed, verdict.first_failure
    assert verdict.compared == 210  # what torch's own checkpoint is compared on


#: (mutant, the engine where it is wrong, what each rank's first failure says, an engine
#: where it is right)
WRONG = [
    ("rng_from_rank_zero", "ddp", "gradients: grad of blocks.0.mlp.fc.weight: relative error",
     "tp"),
    ("rng_from_rank_zero", "fsdp", "gradients: grad of blocks.0.mlp.fc.weight: relative error",
     "tp"),
    ("partitioned_gathered_reversed", "tp", "gradients: grad of blocks.2.mlp.fc.weight: "
     "relative error", "ddp"),
    ("partitioned_over_every_rank", "fsdp", "gradients: grad of blocks.3.x0_gate: relative "
     "error", "tp"),
    ("parameters_captured_at_forward", "fsdp-keep-gathered", "the implementation raised "
     "during step 1 backward: RuntimeError: aten.mul.Tensor got mixed torch.Tensor and "
     "DTensor", "ddp"),
    ("rerun_in_full_precision", "fsdp-bf16", "the implementation raised during step 1 "
     "backward: RuntimeError: expected m1 and m2 to have the same dtype", "fsdp"),
    ("keeps_gathered_parameters", "fsdp", "recompute: step 2: ", "ddp"),
]


@pytest.mark.parametrize("mutant, wrong, says, right", WRONG,
                         ids=[f"{m}-{w}" for m, w, _, _ in WRONG])
def test_each_mutant_fails_on_every_rank_where_it_is_wrong_and_passes_where_it_is_right(
        ranks: RankPool, mutant: str, wrong: str, says: str, right: str) -> None:
    verdict = run(ranks, mutant, wrong)
    assert not verdict.passed and verdict.error is None
    assert verdict.failures == [f"rank {r}: {verdict.verdicts[r].first_failure}"
                                for r in (0, 1)]
    for line in verdict.failures:
        assert says in line, line
    assert run(ranks, mutant, right).passed


def test_kept_parameters_are_named_as_memory_held_past_backward(ranks: RankPool) -> None:
    verdict = run(ranks, "keeps_gathered_parameters", "fsdp-keep-gathered")
    assert not verdict.passed
    line = verdict.failures[0]
    assert "bytes made in the step were still alive after its backward on the recompute " \
           "path" in line
    held, full = (int(line.split(word)[0].split()[-1].strip("(")) for word in
                  (" bytes made", " with full storage"))
    assert held > full


def test_collectives_out_of_order_end_as_a_timeout_not_a_stuck_run(
        ranks: RankPool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "timeout_s", 20.0)
    verdict = run(ranks, "partitioned_own_part_first", "tp")
    assert not verdict.passed
    said = verdict.error or ""
    assert said.startswith("the ranks did not finish within 20 s (a collective that never "
                           "completes?)")
    # where each rank waited: the stack of the collective that never completed
    assert "rank0, where it waited:" in said and "rank1, where it waited:" in said
    assert "distributed_impls.py" in said
    monkeypatch.undo()
    assert run(ranks, "partitioned_own_part_first", "ddp").passed  # the ranks start anew


def test_the_cause_names_the_rank_whose_re_run_parted_from_its_forward(
        ranks: RankPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP every rank's gradients differ once one rank's re-run drew rank 0's masks;
    the rank whose own re-run differs (its first diverging op) is the one the cause names,
    and the case passes in one process."""
    from gradequiv.harness.commands.distributed import Found, likely_cause

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the check in one process
    impl = resolve("distributed_impls:rng_from_rank_zero")
    verdict = ranks.run(CASE, ENGINES["ddp"], impl=impl)
    assert verdict.failures[0].startswith("rank 0:")  # its averaged gradients differ too
    assert verdict.evidence[0]["first_diverging_op"] is None
    diagnosis = likely_cause(impl, Found(CASE, ENGINES["ddp"], verdict))
    assert diagnosis is not None and diagnosis["cause"] == "rng-not-restored"
    assert diagnosis["sentence"].endswith(
        "(rank 1; the same case passes in one process: it goes wrong only across ranks, "
        "under ddp)")
