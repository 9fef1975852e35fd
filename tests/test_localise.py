"""The first diverging op: named for an RNG fault and a lost autocast, absent when correct;
with the random ops each run drew and a re-run's read of a saved output changed since."""

from __future__ import annotations

import pytest
import torch
from test_fault_library import CASES

from gradequiv.harness import Implementation, find_case, resolve
from gradequiv.harness.engine.localise import localise
from gradequiv.harness.implementations.faults import MUTANTS

MUTANT = {m.name: Implementation(m.name, m.impl) for m in MUTANTS}


def test_a_missing_rng_restore_names_the_dropout_op_its_module_and_the_mask_share() -> None:
    found = localise(resolve("torch", kwargs={"preserve_rng_state": False}),
                     find_case("2L-layer-manual-attn"))
    d = found.divergence
    assert d is not None and d.random and d.op.startswith("bernoulli")
    assert d.module.startswith("blocks.0.") and d.segment == "blocks.0"
    # two independent masks at p = 0.1 disagree on 2 * 0.1 * 0.9 = 18% of the elements
    assert 0.1 < d.differing < 0.3
    assert "of the random draws differ" in found.describe()


def test_a_lost_autocast_names_the_first_op_whose_dtype_differs() -> None:
    found = localise(MUTANT["autocast-lost"], find_case("2L-layer-bf16-nodropout"))
    d = found.divergence
    assert d is not None and not d.random
    assert (d.op, d.module) == ("addmm", "blocks.0.attn.qkv")
    assert d.forward.startswith("bfloat16[") and d.recompute.startswith("float32[")


def test_dropped_keyword_arguments_show_as_another_op_sequence() -> None:
    d = localise(MUTANT["kwargs-dropped"], find_case("2L-layer-manual-attn")).divergence
    assert d is not None and d.forward != d.recompute and d.rel_error is None


def test_a_re_run_with_dropout_off_counts_fewer_random_ops() -> None:
    d = localise(MUTANT["dropout-off"], find_case("2L-layer-manual-attn")).divergence
    assert d is not None and d.draws[0] > 0 and d.draws[1] == 0
    assert not d.stale


def test_a_saved_output_changed_in_place_is_a_stale_read_naming_its_op() -> None:
    """The store hands back bmm's output after the forward's in-place scale wrote into it."""
    found = localise(MUTANT["matmul-outputs-cached"], CASES["inplace-manual"])
    d = found.divergence
    assert d is not None and "reads bmm's output from the forward" in d.stale
    assert "stale read: " in found.describe()


@pytest.mark.parametrize("case", ["2L-layer-manual-attn", "1L-layer-dropout"])
@pytest.mark.parametrize("spec", ["wrong_impls:selective_drops_kwargs", "wrong_impls:drops_kwargs",
                                  "no-rng-restore"])
def test_a_store_serving_unchanged_outputs_or_a_re_run_reusing_memory_reads_nothing_stale(
        spec: str, case: str) -> None:
    """torch's selective checkpoint hands the forward's matmul outputs back unchanged, and a
    full re-run allocates where the forward's freed tensors were (on 1L-layer-dropout a
    re-run op's input sits where a forward op's output of other values was): neither is a
    stale read, so the fault keeps its own evidence."""
    impl = MUTANT[spec] if spec in MUTANT else resolve(spec)
    d = localise(impl, find_case(case)).divergence
    assert d is not None and d.stale == "" and d.draws[0] == d.draws[1]


@pytest.mark.parametrize("case", ["2L-layer-manual-attn", "4L-group2-dropout-untied",
                                  "2L-layer-bf16-dropout"])
def test_a_correct_recompute_has_no_diverging_op(case: str) -> None:
    found = localise(resolve("torch"), find_case(case))
    assert found.divergence is None and found.matched
    assert "every recomputed op of step 1 matched" in found.reason


def test_when_nothing_is_recomputed_it_says_so_instead_of_guessing() -> None:
    found = localise(MUTANT["no-op"], find_case("2L-layer-manual-attn"))
    assert found.divergence is None and "no segment ran again during backward" in found.reason
    assert "recomputes no segment" in localise(resolve("torch"),
                                               find_case("control-none")).reason


@pytest.mark.parametrize(("spec", "adapter"), [("wrong_impls:wrapper_that_raises", "wrapper"),
                                               ("wrong_impls:toggle_that_raises", "toggle"),
                                               # a checkpoint function called as a wrapper
                                               ("torch.utils.checkpoint:checkpoint",
                                                "wrapper"),
                                               ("wrong_impls:calls_sys_exit", "function")])
def test_an_implementation_that_raises_or_exits_is_a_finding_not_a_crash(
        spec: str, adapter: str) -> None:
    """Localisation installs and runs the implementation too: what it raises (sys.exit
    included) is said, never let through to crash the run."""
    found = localise(resolve(spec, adapter=adapter), find_case("1L-layer-dropout"))
    assert found.divergence is None and "the implementation raised" in found.describe()


def test_a_masked_op_s_error_is_read_over_its_finite_elements_and_never_nan() -> None:
    """Attention scores masked with -inf: inf - inf is nan, which report.json cannot hold."""
    from gradequiv.harness.engine.localise import _rel_error

    a = torch.tensor([1.0, float("-inf"), 2.0])
    b = torch.tensor([1.0, float("-inf"), 2.5])
    assert _rel_error(a, b) == pytest.approx(0.5 / torch.tensor([1.0, 2.5]).norm().item())
    assert _rel_error(a, torch.tensor([1.0, 0.0, 2.0])) is None  # the mask itself differs
    assert _rel_error(a, a.clone()) == 0.0


def test_a_tensor_the_stale_read_search_cannot_read_turns_it_off_not_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor without storage (a subclass) must not fail the model's run, which would
    read as the implementation raising: the search says nothing, the divergence stands."""
    from gradequiv.harness.engine import localise as search

    def unreadable(tensor: torch.Tensor) -> int:
        raise RuntimeError("no storage")

    monkeypatch.setattr(search, "tensor_key", unreadable)
    found = search.localise(MUTANT["no-rng-restore"], find_case("2L-layer-manual-attn"))
    assert found.divergence is not None and found.divergence.random, found.describe()
    assert found.divergence.stale == ""


def test_an_ops_tensors_are_found_as_a_pytree_walk_finds_them() -> None:
    """The op-level search reads each op's tensors with a flat scan, not a pytree walk (a
    third of its time): on every op of a training step with lists of tensors (cat, stack,
    SDPA, the optimizer's foreach ops), the same tensors in the same order."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from gradequiv.harness.engine.model_watch import first_tensor, op_tensors
    from gradequiv.harness.engine.path import prepare

    seen: list[str] = []

    def tensors(item: object) -> list[torch.Tensor]:
        return [t for t in tree_leaves(item) if isinstance(t, torch.Tensor)]

    class Compare(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            given = op_tensors(args, kwargs)
            assert [id(t) for t in given] == [id(t) for t in tensors((args, kwargs))], func
            returned = tensors(out)
            assert first_tensor(out) is (returned[0] if returned else None), func
            seen.append(str(func))
            return out

    path = prepare(find_case("2L-layer-aux-shared-x0kw-dropout"), resolve("torch"),
                   torch.device("cpu"))
    optimizer = torch.optim.SGD(path.model.parameters(), lr=0.1, foreach=True)
    with Compare():
        loss = path.forward()[1]
        loss.backward()
        optimizer.step()
        torch.stack([torch.cat([loss.reshape(1), loss.reshape(1)])]).unbind(0)
    assert any("_foreach" in op for op in seen) and any("cat" in op for op in seen)
    assert any("unbind" in op for op in seen)
