"""Two faults in one implementation: the headline names one, and the evidence of the other
(a property the first cannot explain) names the second. Each pair is two switches of the
fault library flipped together, on a case that exposes both."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from gradequiv.harness import find_case, verify
from gradequiv.harness.engine.case import Case
from gradequiv.harness.implementations.adapters import Implementation
from gradequiv.harness.implementations.faults import Faults, checkpoint_with_faults
from gradequiv.harness.reports.diagnosis import Diagnosis, diagnose
from gradequiv.harness.reports.report import verdict_record
from gradequiv.models import BatchConfig, BatchNormConfig, TransformerConfig
from gradequiv.properties.assertions import locate

_BATCHNORM_BF16 = Case(model=BatchNormConfig(n_layer=2, width=16), batch=BatchConfig(4, 1),
                       dtype="bf16-autocast")
_BATCHNORM_BF16_INFERENCE = replace(_BATCHNORM_BF16, inference=True)
_INPLACE_DROPOUT = Case(model=TransformerConfig(
    n_layer=2, n_embd=16, n_head=2, max_seq_len=16, inplace_ops=True, attention="manual",
    attn_dropout=0.1, resid_dropout=0.1, mlp_dropout=0.1), batch=BatchConfig(4, 8))


def _diagnosed(switches: tuple[str, ...], case: Case) -> Diagnosis:
    faults = Faults(**dict.fromkeys(switches, True))

    def broken(function: Any, *args: Any, **kwargs: Any) -> Any:
        return checkpoint_with_faults(function, *args, faults=faults, **kwargs)

    impl = Implementation("+".join(switches), broken)
    verdict = verify(impl, case, device="cpu")
    assert not verdict.passed
    record = verdict_record(impl, verdict, torch.device("cpu"))
    prop = next(p["name"] for p in record["properties"] if p["status"] == "fail")
    failure = {"property": prop, "message": verdict.first_failure, "flaky": False,
               "case": case.to_dict(), "description": case.describe(),
               "reproduce": record["reproduce"]}
    locate(impl, failure)
    return diagnose(failure, record)


@pytest.mark.parametrize(("switches", "case", "causes"), [
    # lost autocast changes no RNG stream: the caller's, which the re-run drew from (no
    # restore, no fork_rng: torch's preserve_rng_state=False), is the other fault
    (("no_rng_restore", "caller_stream_moved", "autocast_lost"), "2L-layer-bf16-dropout",
     {"autocast-lost", "rng-not-restored"}),
    (("no_rng_restore", "caller_stream_moved", "kwargs_dropped"), "1L-layer-dropout",
     {"inputs-lost", "rng-not-restored"}),
    (("autocast_lost", "buffers_updated_twice"), _BATCHNORM_BF16,
     {"autocast-lost", "buffers-updated-twice"}),
    (("recomputed_kept", "input_grads_dropped"), "1L-layer-dropout",
     {"leak", "input-grads-dropped"}),
    # a stream left rewound, with autocast lost besides
    (("caller_stream_moved", "autocast_lost"), "2L-layer-bf16-dropout",
     {"autocast-lost", "rng-stream-moved"}),
    # a store handing back an output changed in place, and the re-run's masks drawn anew
    (("matmul_outputs_cached", "no_rng_restore", "caller_stream_moved"), _INPLACE_DROPOUT,
     {"saved-output-changed", "rng-not-restored"}),
    # statistics left to the re-run (behind full storage's after no_grad forwards)
    (("bn_stats_in_recompute_only", "autocast_lost"), _BATCHNORM_BF16_INFERENCE,
     {"autocast-lost", "buffers-missed"}),
])
def test_both_faults_of_a_pair_are_named(switches: tuple[str, ...], case: str | Case,
                                         causes: set[str]) -> None:
    diagnosis = _diagnosed(switches, find_case(case) if isinstance(case, str) else case)
    assert {diagnosis.cause, *diagnosis.also} == causes, diagnosis.sentence
    assert "and a second fault: " in diagnosis.sentence


@pytest.mark.parametrize(("switches", "case"), [
    (("autocast_lost",), "2L-layer-bf16-dropout"), (("no_rng_restore",), "1L-layer-dropout"),
    (("no_rng_restore", "caller_stream_moved"), "1L-layer-dropout"),
    (("kwargs_dropped",), "1L-layer-dropout"), (("input_grads_dropped",), "1L-layer-dropout"),
    (("recomputed_kept",), "1L-layer-dropout")])
def test_one_fault_is_named_once(switches: tuple[str, ...], case: str) -> None:
    """The evidence a single fault leaves is its own cause's, not a second fault: a re-run
    drawing from the caller's stream moves that stream too."""
    diagnosis = _diagnosed(switches, find_case(case))
    assert diagnosis.also == [], diagnosis.sentence


def test_statistics_that_follow_a_differing_forward_are_not_a_second_fault() -> None:
    """Only the RNG not restored, on running statistics over two micro-batches: the second
    micro-batch's forward draws from the stream the re-run moved, so its running mean
    differs, with every counter equal to full storage's. One cause, the RNG's."""
    case = Case(model=TransformerConfig(
        n_layer=1, n_embd=4, n_head=1, embd_dropout=0.3, attn_dropout=0.3, resid_dropout=0.3,
        mlp_dropout=0.3, running_stats=True), batch=BatchConfig(1, 1), dtype="bf16-autocast",
        grad_mode="accumulate")
    diagnosis = _diagnosed(("no_rng_restore", "caller_stream_moved"), case)
    assert diagnosis.cause == "rng-not-restored", diagnosis.sentence
    assert diagnosis.also == [], diagnosis.sentence
