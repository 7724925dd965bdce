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


def _cuda_all_gather_overlaps_compute() -> dict:
    """Block 0 computes for a long time; block 1's prefetched all-gather must finish meanwhile."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from fsdp2._streams import streams_for
    from tests._models import Transformer, make_batch

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    device = torch.device("cuda", torch.cuda.current_device())
    model = Transformer().to(device)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    inputs, targets = make_batch(dist.get_rank(), 0, device=device)
    model(inputs).sum().backward()  # first iteration: learns the order for implicit prefetch
    seen = {}

    def slow_then_check(module, args, output):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the compute stream
        # Wait for the compute stream only: the all-gather stream is not waited on.
        torch.cuda.current_stream().synchronize()
        gather = model.layers[1]._fsdp_state().group._gather
        seen["in_flight_or_done"] = gather is not None
        seen["done_during_compute"] = gather is not None and gather.done.event is not None and gather.done.event.query()

    handle = model.layers[0].register_forward_hook(slow_then_check)
    model(inputs).sum().backward()
    handle.remove()
    torch.cuda.synchronize()
    streams = streams_for(device)
    seen["side_streams"] = len({streams.copy_in, streams.all_gather, streams.reduce_scatter,
                                torch.cuda.current_stream()}) == 4
    return seen


@needs_two_gpus
def test_cuda_prefetched_all_gather_overlaps_compute_on_its_own_stream():
    for seen in _launch("_cuda_all_gather_overlaps_compute"):
        assert seen == {"in_flight_or_done": True, "done_during_compute": True, "side_streams": True}


needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tracker_vs_allocator() -> tuple[int, int, int]:
    """A CUDA model's step under MemoryTracker: its peak growth against the allocator's."""
    import fsdp2

    device = torch.device("cuda", torch.cuda.current_device())
    big = 4096  # 64 MiB per fp32 weight: the allocator's rounding and cuBLAS's workspace are noise
    model = torch.nn.Sequential(*(torch.nn.Linear(big, big, bias=False) for _ in range(3))).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(1024, big, device=device)
    model(x).square().mean().backward()  # cuBLAS handles and workspaces exist from here on
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    with fsdp2.MemoryTracker(model, opt) as tracker:
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    report = tracker.report
    entry = sum(p.numel() * p.element_size() for p in model.parameters()) + x.numel() * x.element_size()
    return report.peak_bytes - entry, report.device_peak_bytes - held, report.device_peak_bytes


@needs_a_gpu
def test_tracker_peak_matches_the_cuda_allocator():
    (tracked, allocator, device_peak), = _launch("_tracker_vs_allocator", world=1)
    assert device_peak > 0
    assert allocator > 3 * 64 * 2**20  # the gradients alone are three 64 MiB tensors
    assert abs(tracked - allocator) / allocator < 0.05, (tracked, allocator)
