"""Sharded tensors made whole in one call are the tensors ``full_tensor`` gives, row by row:
a gather that put a rank's rows in another's place would be the same on both paths and
pass every comparison, so it is checked against torch's own here."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: uneven row counts (3 ranks: 5 rows are 2, 2, 1; 1 row leaves two ranks empty), several
#: dtypes, rows of several shapes
SHAPES = [((5, 3), torch.float32), ((1, 4), torch.float32), ((7,), torch.bfloat16),
          ((4, 2, 3), torch.float32), ((2, 2), torch.bfloat16), ((9, 1), torch.float64)]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gradequiv.harness.engine.parallel import RankSetup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in SHAPES]
        tensors = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]
        tensors += [None, torch.ones(2), distribute_tensor(full[0], mesh, [Replicate()])]
        got = RankSetup.whole(tensors)
        want = [t.full_tensor() for t in tensors[:len(SHAPES)]]
        same = all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want))
        same = same and got[len(SHAPES)] is None and torch.equal(got[-2], torch.ones(2))
        same = same and torch.equal(got[-1], full[0])
        Path(out, str(rank)).write_text(str(same))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_row_shards_gathered_in_one_call_are_torchs_whole_tensors(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(3, port, str(tmp_path)), nprocs=3)
    assert [Path(tmp_path, str(r)).read_text() for r in range(3)] == ["True"] * 3
