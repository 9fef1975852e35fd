"""Full-storage step against recompute step on a fixed set of configs (pytest-benchmark).

Run: ``tox -e bench``. Each config is one benchmark group with a ``full`` and
a ``recompute`` (per-layer torch checkpoint) member; compare within a group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradequiv.harness import Case, resolve
from gradequiv.models import BatchConfig, TransformerConfig, build, parse_granularity

CONFIGS = {
    "2L-64w-64t": (2, 64, 64),
    "4L-128w-64t": (4, 128, 64),
    "8L-64w-128t": (8, 64, 128),
}


@pytest.mark.parametrize("granularity", ["none", "layer"], ids=["full", "recompute"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_step(benchmark: Any, config: str, granularity: str) -> None:
    n_layer, width, seq = CONFIGS[config]
    model = TransformerConfig(n_layer=n_layer, n_embd=width, n_head=4, max_seq_len=seq,
                              embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1,
                              mlp_dropout=0.1)
    case = Case(model=model, batch=BatchConfig(4, seq, padding=False))
    workload = build(case.model, case.batch, case.seed)
    resolve("torch").install(workload.model, workload.segments(parse_granularity(granularity)))
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(workload.model(*workload.inputs), workload.targets)
        loss.backward()
        optimizer.step()

    benchmark.group = config
    benchmark.extra_info.update(threads=torch.get_num_threads(), torch=torch.__version__,
                                tokens_per_step=4 * seq, granularity=granularity)
    benchmark.pedantic(step, rounds=20, warmup_rounds=3, iterations=1)
