"""Correct recomputes beside the training-loop faults: each keeps what a call needs between
its forward and its backward per call, or reads what trains at every call, and so passes
the cases of how real training loops drive a segment (micro-batches in flight, a loss
backpropagated in parts, backward inside autocast, partial fine-tuning) as well as the
plain one. The fault library's mutants of the same families fail there
(tests/test_fault_library.py)."""

from __future__ import annotations

import correct_impls
import pytest

from gradequiv.harness import find_case, verify
from gradequiv.harness.implementations.adapters import Implementation

#: The spread's training-loop cases, and the plain one every peer passes too.
CASES = ("2L-layer-gpipe-dropout", "2L-layer-gpipe-reverse-two-losses-dropout",
         "2L-layer-1f1b-dropout", "2L-layer-summed-micro-batches-dropout",
         "2L-layer-two-losses-dropout", "2L-layer-bf16-fp32-last-layer-backward-autocast",
         "2L-layer-fp32-backward-autocast-dropout", "3L-layer-frozen-layer-dropout",
         "2L-layer-changing-trainable-dropout", "2L-layer-adapters-only-dropout",
         "2L-layer-manual-attn")

PEERS = ("call_keyed_stash_checkpoint", "host_pool_checkpoint", "cleared_leaves_checkpoint",
         "per_call_trainable_checkpoint", "graph_task_checkpoint")


#: Each peer's own family, in the default suite; every other pair in the slow sweep.
_OWN = {"call_keyed_stash_checkpoint": ("2L-layer-gpipe-dropout", "2L-layer-1f1b-dropout"),
        "host_pool_checkpoint": ("2L-layer-1f1b-dropout", "2L-layer-two-losses-dropout"),
        "cleared_leaves_checkpoint": ("2L-layer-gpipe-reverse-two-losses-dropout",),
        "per_call_trainable_checkpoint": ("2L-layer-changing-trainable-dropout",
                                          "3L-layer-frozen-layer-dropout"),
        "graph_task_checkpoint": ("2L-layer-two-losses-dropout",
                                  "2L-layer-bf16-fp32-last-layer-backward-autocast")}


def _pairs() -> list[object]:
    return [pytest.param(peer, case, id=f"{peer}-{case}",
                         marks=() if case in _OWN[peer] else pytest.mark.slow)
            for peer in PEERS for case in CASES]


@pytest.mark.parametrize(("peer", "case_name"), _pairs())
def test_the_peer_passes(peer: str, case_name: str) -> None:
    correct_impls.reset()
    impl = Implementation(peer, getattr(correct_impls, peer))
    verdict = verify(impl, find_case(case_name))
    assert verdict.passed, verdict.first_failure


def test_nothing_stays_stashed_or_lent_after_the_cases() -> None:
    """Each call's stash entry goes with its context; the pool holds only free buffers."""
    correct_impls.reset()
    verify(Implementation("stash", correct_impls.call_keyed_stash_checkpoint),
           find_case("2L-layer-1f1b-dropout"))
    assert not correct_impls._STASH
