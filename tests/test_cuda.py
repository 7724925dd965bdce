"""CUDA + NCCL: the same schedule code as on CPU, checked on real GPUs.

These run only where at least two CUDA devices exist (NCCL needs one device per
rank); elsewhere they are skipped. They launch their own NCCL world instead of
using the session's gloo pool.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn_name: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        results[rank] = globals()[fn_name]()
    finally:
        dist.destroy_process_group()


def _launch(fn_name: str, world: int = 2) -> list:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, _free_port(), fn_name, results), nprocs=world)
        return [results[r] for r in range(world)]


def _cuda_parity() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from tests._models import Transformer
    from tests._parity import train_parity

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    device = torch.device("cuda", torch.cuda.current_device())

    def build() -> Transformer:
        return Transformer().to(device)

    def batch(rank: int, step: int):
        from tests._models import make_batch
        return make_batch(rank, step, device=device)

    holder = []

    def shard(model: Transformer) -> None:
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        holder.append(model)

    train_parity(build, shard, batch=batch, atol=1e-4, rtol=1e-4)
    model = holder[0]
    assert all(p.device.type == "cuda" for p in model.parameters())
    inputs, targets = batch(dist.get_rank(), 9)
    with fsdp2.record_schedule() as events:
        model(inputs).sum().backward()
    torch.cuda.synchronize()
    return list(events)


@needs_two_gpus
def test_cuda_parity_and_prefetch_schedule():
    traces = _launch("_cuda_parity")
    assert traces[0] == traces[1]
    fwd = traces[0]
    # Implicit forward prefetch on CUDA too: the next block's all-gather is issued before
    # the previous block is freed (the all-gather runs on NCCL's stream meanwhile).
    assert fwd.index("unshard layers.1") < fwd.index("reshard layers.0"), fwd
