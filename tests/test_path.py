"""One way to prepare a path: the same weights, routing, inputs and training stream for all."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradequiv.harness import Implementation, find_case, resolve
from gradequiv.harness.commands.profiling import profile
from gradequiv.harness.engine.localise import localise
from gradequiv.harness.engine.path import PreparedPath, prepare, training_seed
from gradequiv.harness.engine.runner import run_path

CPU = torch.device("cpu")


class _FirstCall:
    """A plain pass-through implementation that notes the training stream at its first call."""

    def __init__(self) -> None:
        self.stream: tuple[int, Tensor] | None = None  # (initial seed, generator state)

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.stream is None:
            self.stream = torch.initial_seed(), torch.get_rng_state()
        return fn(*args, **kwargs)


def _stream_seen(caller: str) -> tuple[int, Tensor]:
    case = find_case("2L-layer-manual-attn")
    watch = _FirstCall()
    impl = Implementation("first-call", watch)
    torch.default_generator.manual_seed(12345)  # whatever the stream was before, it is reseeded
    if caller == "runner":
        run_path(case, impl, device=CPU)
    elif caller == "localise":
        localise(impl, case)
    else:
        profile(impl, case, [case.granularity], steps=1, warmup=0)
    assert watch.stream is not None, f"{caller} never called the first segment"
    return watch.stream


def test_runner_localise_and_profile_draw_from_one_training_stream() -> None:
    case = find_case("2L-layer-manual-attn")
    streams = {caller: _stream_seen(caller) for caller in ("runner", "localise", "profile")}
    assert {seed for seed, _ in streams.values()} == {training_seed(case)}
    runner_state = streams["runner"][1]
    for caller, (_, state) in streams.items():  # the same draws before the first segment too
        assert torch.equal(state, runner_state), caller


def test_the_training_stream_is_not_the_stream_that_made_the_weights() -> None:
    case = find_case("2L-layer-manual-attn")
    assert training_seed(case) != case.seed
    assert training_seed(case.with_seed_offset(5)) == training_seed(case) + 5


def test_prepare_without_an_implementation_installs_every_segment_plainly() -> None:
    path = prepare(find_case("2L-layer-manual-attn"), None, CPU)
    router = path.model.router
    assert path.segments and path.model.training
    assert all(router.installed(s.module) and not router.routes(s.module) for s in path.segments)
    routed = prepare(find_case("2L-layer-manual-attn"), resolve("torch"), CPU)
    assert all(routed.model.router.routes(s.module) for s in routed.segments)


def _state(path: PreparedPath) -> dict[str, Tensor]:
    state = {f"param:{n}": p.detach() for n, p in path.model.named_parameters()}
    state |= {f"buffer:{n}": b for n, b in path.model.named_buffers()}
    state |= {f"input:{i}": t for i, t in enumerate(path.inputs) if t is not None}
    return state | {"targets": path.targets, "rng": torch.get_rng_state()}


def test_two_prepares_of_one_case_are_bitwise_equal_and_draw_the_same_masks() -> None:
    case = find_case("batchnorm-layer")  # dropout, BatchNorm buffers and an input with a grad
    first = prepare(case, None, CPU)
    one = _state(first)
    loss_one = first.forward()[1]
    second = prepare(case, None, CPU)
    two = _state(second)
    loss_two = second.forward()[1]
    assert one.keys() == two.keys() and any(k.startswith("buffer:") for k in one)
    assert all(torch.equal(one[k], two[k]) for k in one), [k for k in one
                                                           if not torch.equal(one[k], two[k])]
    assert torch.equal(loss_one, loss_two)  # the stream was seeded again: the same masks


def test_each_path_gets_input_leaves_of_its_own() -> None:
    path = prepare(find_case("batchnorm-layer"), None, CPU)
    (mine,), (built,) = path.inputs, path.workload.inputs
    assert mine is not None and built is not None and mine is not built
    assert mine.is_leaf and mine.requires_grad and torch.equal(mine, built)
    path.forward()[1].backward()  # type: ignore[no-untyped-call]  # untyped in torch
    assert mine.grad is not None and built.grad is None
    assert any(t is mine for t in path.not_activations())


def test_a_rank_offset_seeds_its_own_stream() -> None:
    case = find_case("2L-layer-manual-attn")
    prepare(case, None, CPU, seed_offset=3)
    assert torch.initial_seed() == training_seed(case) + 3


def test_the_forward_runs_under_the_case_autocast() -> None:
    outputs, loss = prepare(find_case("2L-layer-bf16-dropout"), None, CPU).forward()
    assert outputs.dtype == torch.bfloat16 and loss.dtype == torch.float32
    outputs, _ = prepare(find_case("2L-layer-manual-attn"), None, CPU).forward()
    assert outputs.dtype == torch.float32
