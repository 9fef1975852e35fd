"""A mixture of experts in the reference transformer (``moe_top_k``): routing turns a re-run
one rounding step or one jitter draw away from its forward into tokens sent to other
experts, which a dense layer hides within a tolerance. torch's checkpoints pass it, the
load statistic is counted once per training forward, and a re-run that routes otherwise is
told by the tokens it moved, before why."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import find, settings
from test_diagnosis import diagnosed

from gradequiv.harness import Case, find_case, verify
from gradequiv.harness.engine.localise import localise
from gradequiv.harness.engine.spread import load_case
from gradequiv.harness.implementations.faults import MUTANTS
from gradequiv.harness.implementations.resolve import resolve
from gradequiv.models import BatchConfig, TransformerConfig, build, parse_granularity
from gradequiv.models.transformer import MOE_EXPERTS, MoE, _within_capacity
from gradequiv.properties.strategies import cases, transformer_configs

NAMED = ("2L-layer-moe-top2-dropout", "2L-mlp-bf16-moe-top1")
FAULTS = "gradequiv.harness.implementations.faults:"
_SMALL = TransformerConfig(n_layer=2, n_embd=16, n_head=2, max_seq_len=16)


def _case(top_k: int, *, granularity: str = "layer", dtype: str = "fp32", seed: int = 3) -> Case:
    return Case(model=replace(_SMALL, moe_top_k=top_k), batch=BatchConfig(4, 16),
                granularity=parse_granularity(granularity), dtype=dtype, seed=seed)


def test_experts_are_drawn_off_first_named_and_replayed() -> None:
    quiet = settings(database=None, max_examples=300)
    assert find(transformer_configs(), lambda c: True, settings=quiet).moe_top_k == 0
    drawn = find(cases(), lambda c: c.model.moe_top_k == 2, settings=quiet)
    assert drawn.model == replace(TransformerConfig(n_embd=4, n_head=1, ffn_mult=2,
                                                    vocab_size=32, n_layer=1),
                                  moe_top_k=2)  # all else shrunk away
    assert ", MoE top-2," in drawn.describe()
    again = load_case(drawn.to_json())
    assert again == drawn and again.to_dict()["model"]["moe_top_k"] == 2
    assert [find_case(name).model.moe_top_k for name in NAMED] == [2, 1]


def test_a_top_k_outside_one_and_two_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match=r"moe_top_k=3: must be 0 \(a dense MLP\), 1 or 2"):
        TransformerConfig(moe_top_k=3)


def test_tokens_past_an_expert_s_capacity_are_dropped_first_choices_first() -> None:
    every_token_to_one = torch.zeros(8, 2, dtype=torch.long)
    every_token_to_one[:, 1] = 1  # second choices: expert 1
    kept = _within_capacity(every_token_to_one)
    capacity = 5  # ceil(1.25 * 8 tokens * 2 choices / 4 experts)
    assert kept[:, 0].tolist() == [True] * capacity + [False] * (8 - capacity)
    assert kept[:, 1].tolist() == [True] * capacity + [False] * (8 - capacity)
    spread = torch.arange(8).remainder(MOE_EXPERTS)[:, None]
    assert bool(_within_capacity(spread).all())


@pytest.mark.parametrize("spec", ["torch", "torch-reentrant"])
@pytest.mark.parametrize("name", NAMED)
def test_torch_s_checkpoints_pass_the_experts(spec: str, name: str) -> None:
    verdict = verify(spec, find_case(name))
    assert verdict.passed and verdict.error is None, verdict.first_failure
    assert {p.name for p in verdict.properties if p.passed} >= {"gradients", "buffers"}


def _loads(top_k: int, *, checkpointed: bool) -> list[list[int]]:
    """Each layer's tokens per expert after one training step, the MLPs re-run in backward
    by torch's checkpoint where ``checkpointed``."""
    from torch.utils.checkpoint import checkpoint

    workload = build(replace(_SMALL, moe_top_k=top_k), BatchConfig(4, 16), 0)
    model = workload.model.train()
    torch.manual_seed(1)  # the router's jitter noise: the same draws on both paths
    for block in model.blocks:
        mlp = block.mlp
        assert isinstance(mlp, MoE)
        if checkpointed:
            mlp.forward = (lambda run: lambda h: checkpoint(run, h, use_reentrant=False)
                           )(mlp.forward)
    out = model(*workload.inputs)
    out.float().sum().backward()
    return [block.mlp.tokens_per_expert.tolist() for block in model.blocks]


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_expert_load_is_counted_once_per_training_forward_not_by_its_re_run(
        top_k: int) -> None:
    plain, rerun = _loads(top_k, checkpointed=False), _loads(top_k, checkpointed=True)
    assert plain == rerun
    tokens = 4 * 16
    for load in plain:
        assert 0 < sum(load) <= tokens * top_k  # some choices past capacity may be dropped


def test_a_re_run_with_other_jitter_noise_is_told_by_the_tokens_it_sent_elsewhere() -> None:
    cause, sentence, failure = diagnosed(FAULTS + "no_rng_restore", NAMED[0])
    assert cause == "rng-not-restored"
    moved = failure["first_diverging_op"]["rerouted"]
    assert moved.startswith("the re-run sent ") and moved.endswith(
        " to other experts than the forward did")
    assert sentence.startswith(f"{moved}, as the recompute does not restore the RNG state")


def test_a_dense_model_s_divergence_says_nothing_of_routing() -> None:
    dropout = replace(_case(0), model=replace(_SMALL, resid_dropout=0.1))
    dense = localise(resolve(FAULTS + "no_rng_restore"), dropout).divergence
    assert dense is not None and dense.rerouted == ""


def test_a_re_run_with_another_attention_kernel_fails_dense_and_routed() -> None:
    """Outside the forward's backend choice the re-run computes attention by the math
    kernel: one rounding step off in fp32 (within the bound on some seeds), more in bf16."""
    assert "rerun-other-attention-kernel" in {m.name for m in MUTANTS}
    for top_k in (0, 2):
        case = _case(top_k, dtype="bf16-autocast")
        verdict = verify(FAULTS + "rerun_other_attention_kernel", case)
        assert not verdict.passed and verdict.error is None
        divergence = localise(resolve(FAULTS + "rerun_other_attention_kernel"),
                              case).divergence
        assert divergence is not None
        assert divergence.forward.startswith("_scaled_dot_product")


def test_another_attention_kernel_in_the_re_run_is_named_as_such() -> None:
    cause, sentence, _ = diagnosed(FAULTS + "rerun_other_attention_kernel",
                                   "2L-layer-bf16-nodropout")
    assert cause == "kernel-changed"
    assert sentence.startswith("the re-run of blocks.0 computes attention in blocks.0.attn "
                               "with another kernel than its forward (forward: "
                               "_scaled_dot_product_flash_attention_for_cpu")


def test_the_engines_refuse_experts_with_the_fix() -> None:
    from gradequiv.harness.commands.distributed import case_refusal

    said = case_refusal(_case(1), 2)
    assert said.startswith("moe_top_k=1: ") and said.endswith("give the case moe_top_k=0")
    assert case_refusal(_case(0), 2) == ""


def test_experts_take_in_place_ops_hooks_and_outside_gates() -> None:
    """Every knob of the dense MLP beside the experts (the shared expert takes the LoRA)."""
    model = replace(_SMALL, moe_top_k=2, inplace_ops=True, value_hooks=True,
                    outside_params=True, running_stats=True, resid_dropout=0.1,
                    activation="relu")
    for granularity in ("layer", "mlp"):
        case = Case(model=model, batch=BatchConfig(2, 8),
                    granularity=parse_granularity(granularity))
        verdict = verify("torch", case)
        assert verdict.passed and verdict.error is None, verdict.first_failure
