"""Offload, the other way to save activation memory: equal gradients, nothing re-run,
and on an accelerator fewer bytes left on it (checked here on recorded paths)."""

from __future__ import annotations

import pytest
import torch

from gradequiv.harness import find_case, resolve, verify
from gradequiv.harness.commands.profiling import profile
from gradequiv.harness.engine.memory import ActivationCounter
from gradequiv.harness.engine.runner import PathRun
from gradequiv.harness.engine.verify import _check_offload
from gradequiv.harness.reports.markdown import profile_markdown
from gradequiv.models import parse_granularity


@pytest.mark.parametrize("spec", ["torch-offload", "torch-offload-wrapper"])
def test_torch_offload_is_exact_and_runs_each_segment_once(spec: str) -> None:
    verdict = verify(spec, find_case("2L-layer-manual-attn"))
    assert verdict.passed, verdict.first_failure
    assert resolve(spec).offloads
    gradients = next(p for p in verdict.properties if p.name == "gradients")
    assert all(c.mismatched == 0 for c in gradients.checks)  # nothing recomputed: bitwise
    recompute = verdict.properties[-1]
    assert "not again in backward" in recompute.summary and "CPU device" in recompute.summary
    assert verdict.held_on["recompute"] is not None and "cpu" in verdict.held_on["recompute"]


def test_an_offload_that_re_runs_its_segments_is_caught() -> None:
    verdict = verify("wrong_impls:offload_that_recomputes", find_case("2L-layer-manual-attn"))
    recompute = verdict.properties[-1]
    assert recompute.passed is False and "1 in backward" in recompute.summary


def test_an_offload_that_draws_fresh_masks_fails_its_gradients() -> None:
    verdict = verify("wrong_impls:offload_with_fresh_masks", find_case("2L-layer-manual-attn"))
    failed = {p.name for p in verdict.properties if p.passed is False}
    assert {"gradients", "recompute"} <= failed


def _path(held_on: dict[str, int]) -> PathRun:
    return PathRun(held_bytes=sum(held_on.values()), held_on=held_on)


def test_on_an_accelerator_the_bytes_must_leave_it() -> None:
    case, cuda = find_case("2L-layer-manual-attn"), torch.device("cuda", 0)
    full = _path({"cuda:0": 1000})
    moved = _check_offload(case, full, _path({"cuda:0": 100, "cpu": 900}), cuda)
    assert moved.passed and "900 bytes moved off cuda:0, 900 bytes held on the host" in (
        moved.summary)
    stayed = _check_offload(case, full, _path({"cuda:0": 1000}), cuda)
    assert stayed.passed is False and "nothing moved to the host" in stayed.summary


def test_held_bytes_by_device_adds_up_to_the_total() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    with ActivationCounter(exclude=[x]) as counter:
        y = torch.tanh(x @ x).sum()
    by_device = counter.held_bytes_by_device(ignore=[y])
    assert by_device == {"cpu": counter.held_bytes(ignore=[y])} and by_device["cpu"] > 0


def test_the_profile_says_where_the_bytes_were() -> None:
    case = find_case("2L-layer-manual-attn")
    result = profile(resolve("torch-offload"), case, [parse_granularity("layer")], steps=1,
                     warmup=0)
    row = result.rows[0]
    assert row.held_on == {"cpu": row.held_bytes}  # a CPU device: the host is the device
    assert "Where the activation bytes" not in profile_markdown(result.to_dict())
    row.held_on = {"cpu": 900, "cuda:0": 100}  # as an offload on CUDA would leave them
    assert "| layer | 900 | 100 |" in profile_markdown(result.to_dict())
