"""CUDA + NCCL: the same schedule code as on CPU, checked on real GPUs.

Run on one H100 (``benchmarks/gpu_check.sh``, 2026-11-25): the tests that fit one GPU pass.
Every test here skips cleanly without CUDA. NCCL needs one device per rank, so the
multi-rank tests take two GPUs where there are two and one where one is all there is; the
two that need an all-gather need two (at world size 1 fsdp2 gathers nothing), the subgroup
test four. They launch their own NCCL world instead of using the session's gloo pool.

Run them on a GPU machine under PyTorch's CUDA stream sanitizer, which reports a kernel
that touches memory another stream uses without an event between them (the class of bug
these tests are about: fsdp2 runs copy-in, all-gather, reduce-scatter and all-reduce on
side streams)::

    TORCH_CUDA_SANITIZER=1 python -m pytest tests/comm/test_cuda.py -v

The hazards the CPU-only review found, each fixed by construction and checked here (the
parts of their logic that also run on CPU: ``tests/comm/test_gpu_path.py``):

* an explicit ``unshard(async_op=True)`` sends a copy of the shards, made before anything
  later on the compute stream (``optimizer.step()``) can write them;
* ``Completion.wait`` orders every waiting stream after the stage, not just the first;
* HSDP's all-reduce, the post-divide and the accumulation into ``.grad`` run on the
  all-reduce stream, not the compute stream;
* CPU offload copies gradients to pinned host memory without blocking, landed (host
  synchronised) before backward returns;
* HSDP with gradient accumulation: the partial sums of a step without all-reduce stay
  alive until the all-reduce stream has added them in (runs on one GPU too);
* one subgroup per (mesh, k) for an int ``reshard_after_forward``.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.cuda  # every test here needs CUDA devices (each also skips without them)

# NCCL needs one device per rank: the multi-rank tests run on two GPUs where there are two, and on
# one (a world of one rank, still through NCCL and fsdp2's side streams) where one is all there is.
WORLD = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
needs_a_gpu = pytest.mark.skipif(WORLD < 1, reason="needs a CUDA device")
# At world size 1 fsdp2 gathers nothing (the shard is the whole parameter: no collective, no
# all-gather stream): what these tests watch needs a second rank, hence a second GPU.
needs_two_gpus = pytest.mark.skipif(WORLD < 2, reason="needs 2 CUDA devices (a world of one rank gathers nothing)")


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


def _cuda_transformer(root: bool = True, **fully_shard_kwargs):
    """tests._models.Transformer on this rank's GPU, each block (and the root) sharded with
    ``fully_shard_kwargs`` over all ranks; (model, device)."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from tests._models import Transformer

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    device = torch.device("cuda", torch.cuda.current_device())
    model = Transformer().to(device)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    if root:
        fsdp2.fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model, device


def _launch(fn_name: str, world: int = WORLD) -> list:
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


@needs_a_gpu
def test_cuda_parity_and_prefetch_schedule():
    traces = _launch("_cuda_parity")
    assert all(trace == traces[0] for trace in traces)
    fwd = traces[0]
    # Implicit forward prefetch on CUDA too: the next block's all-gather is issued before
    # the previous block is freed (the all-gather runs on NCCL's stream meanwhile).
    assert fwd.index("unshard layers.1") < fwd.index("reshard layers.0"), fwd


def _cuda_all_gather_overlaps_compute() -> dict:
    """Block 0 computes for a long time; block 1's prefetched all-gather must finish meanwhile."""
    from fsdp2.comm._streams import streams_for
    from tests._models import make_batch

    model, device = _cuda_transformer()
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


# ---- the hazards (see the module docstring) ---------------------------------------------

def _completion_every_stream_waits() -> list[bool]:
    from fsdp2.comm._streams import Completion

    device = torch.device("cuda", torch.cuda.current_device())
    side, first, second = (torch.cuda.Stream(device) for _ in range(3))
    value = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the waiters are issued long before it ends
        value.fill_(7.0)
        event = torch.cuda.Event()
        event.record(side)
    done = Completion(event=event)
    seen = {}
    for name, stream in (("first", first), ("second", second)):
        with torch.cuda.stream(stream):
            done.wait()
            done.wait()  # idempotent on the same stream
            seen[name] = value.clone()
    torch.cuda.synchronize()
    return [bool((seen["first"] == 7).all()), bool((seen["second"] == 7).all()),
            done.waited_on(first), done.waited_on(second), not done.waited_on(side)]


@needs_a_gpu
def test_cuda_completion_orders_every_waiting_stream():
    (flags,) = _launch("_completion_every_stream_waits", world=1)
    assert flags == [True] * 5, flags


def _explicit_async_unshard_on_cuda() -> list[bool]:
    model, device = _cuda_transformer()
    block = model.layers[1]
    group = block._fsdp_state().group
    expected = block.qkv.weight.full_tensor().clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the compute stream is busy: the copy-in and all-gather queue behind it
    handle = block.unshard(async_op=True)
    private = group._gather.send.data_ptr() != group._packed.data_ptr()
    with torch.no_grad():
        block.qkv.weight.to_local().add_(1000.0)  # optimizer.step() before the wait
    handle.wait()
    gathered = block.qkv.weight.detach().clone()
    block.reshard()
    torch.cuda.synchronize()
    return [private, torch.equal(gathered, expected)]


@needs_two_gpus
def test_cuda_explicit_async_unshard_gathers_the_values_at_issue_time():
    for flags in _launch("_explicit_async_unshard_on_cuda"):
        assert flags == [True, True], flags


def _hsdp_all_reduce_on_its_own_stream() -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from fsdp2.comm._streams import streams_for
    from tests._models import Transformer, make_batch
    from tests._parity import train_parity

    mesh = init_device_mesh("cuda", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    device = torch.device("cuda", torch.cuda.current_device())
    streams_seen = []

    def hook(grad: torch.Tensor) -> None:  # runs where the all-reduce stage runs
        streams_seen.append(torch.cuda.current_stream(device))

    def shard(model: Transformer) -> None:
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        model.set_all_reduce_hook(hook)

    train_parity(lambda: Transformer().to(device), shard,
                 batch=lambda rank, step: make_batch(rank, step, device=device), atol=1e-4, rtol=1e-4)
    torch.cuda.synchronize()
    side = streams_for(device).all_reduce
    return [bool(streams_seen), all(s == side for s in streams_seen)]


@needs_a_gpu
def test_cuda_hsdp_all_reduce_runs_on_the_all_reduce_stream():
    for flags in _launch("_hsdp_all_reduce_on_its_own_stream"):
        assert flags == [True, True], flags


def _hsdp_accumulation_keeps_partial_sums() -> list[str]:
    """HSDP over every rank's GPU (replicas of one shard), one step of two microbatches: the
    first with the all-reduce off (each group's reduce-scattered sum is kept), the second
    adding the kept sums in on the all-reduce stream. A hook sleeping on that stream holds it
    back, so the next groups' reduce-scatters run before it has read the kept sums: a sum
    freed when the host moved on would have its memory handed to the next reduce-scatter of
    the same size (the blocks are alike) and overwritten. The parameters whose gradients
    differ from an unsharded reference's (none)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from tests._models import Transformer, lm_loss, make_batch

    mesh = init_device_mesh("cuda", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    reference = Transformer(n_layers=6).to(device)
    model = copy.deepcopy(reference)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)

    def hold_back(reduced: torch.Tensor) -> None:  # on the all-reduce stream, ahead of the next group's add
        torch.cuda._sleep(100_000_000)

    for module in (*model.layers, model):
        module.set_all_reduce_hook(hold_back)
    for micro, sync in ((0, False), (1, True)):
        inputs, targets = make_batch(0, micro, device=device)  # one batch for every replica: the mean is its gradient
        model.set_requires_all_reduce(sync)
        lm_loss(model(inputs), targets).backward()
        lm_loss(reference(inputs), targets).backward()
    torch.cuda.synchronize()
    expected = dict(reference.named_parameters())
    return [name for name, p in model.named_parameters()
            if not torch.allclose(p.grad.full_tensor(), expected[name].grad, atol=1e-5, rtol=1e-4)]


@needs_a_gpu
def test_cuda_hsdp_accumulation_keeps_partial_sums_until_the_all_reduce_stream_has_read_them():
    for wrong in _launch("_hsdp_accumulation_keeps_partial_sums", world=min(2, torch.cuda.device_count())):
        assert wrong == [], wrong


def _offload_pinned_non_blocking() -> list[bool]:
    import fsdp2
    from tests._models import lm_loss, make_batch

    on_gpu, device = _cuda_transformer(offload_policy=fsdp2.OffloadPolicy())
    offloaded, _ = _cuda_transformer(offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=True))
    x, y = make_batch(dist.get_rank(), 5, device=device)
    grads = []
    for model in (on_gpu, offloaded):
        for _ in range(2):  # the second backward accumulates into .grad (on the host when offloaded)
            lm_loss(model(x), y).backward()
        grads.append({n: p.grad.to_local() for n, p in model.named_parameters()})
    reference, host = grads
    return [all(g.device.type == "cpu" for g in host.values()),
            all(g.is_pinned() or g.numel() == 0 for g in host.values()),
            all(torch.allclose(host[n], reference[n].cpu(), atol=1e-5, rtol=1e-4) for n in reference)]


@needs_a_gpu
def test_cuda_offload_gradients_land_in_pinned_host_memory():
    for flags in _launch("_offload_pinned_non_blocking"):
        assert flags == [True, True, True], flags


def _subgroups_cached_on_nccl() -> list[bool]:
    model, _ = _cuda_transformer(root=False, reshard_after_forward=2)
    groups = {id(block._fsdp_state().group.subgroup.group) for block in model.layers}
    return [len(groups) == 1]


needs_four_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 CUDA devices"
)


@needs_four_gpus
def test_cuda_one_nccl_subgroup_per_mesh_and_k():
    for flags in _launch("_subgroups_cached_on_nccl", world=4):
        assert flags == [True], flags


def _fake_world(_index: int, fn_name: str, world: int, results) -> None:
    """In a spawned process: rank 0 of torch's fake process group of ``world`` ranks (its
    all-gather fills every rank's slice with this rank's), ``fn_name``'s result into ``results``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ["FSDP2_CPU_COLLECTIVES"] = "flat"  # the CPU exchange needs real peers
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        results[0] = globals()[fn_name]()
    finally:
        dist.destroy_process_group()


def _copy_out_on_both_devices() -> dict:
    """One forward of the same sharded model on the CPU and on CUDA in a fake world of 4: the
    unsharded weights each block saw, and whether CUDA's copy-out ran as torch's fused
    ``split_with_sizes_copy`` kernel (no per-parameter ``aten::copy_`` under it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    import fsdp2
    from tests._models import Transformer, make_batch

    seen: dict[str, list[torch.Tensor]] = {}
    fused = []
    for device in (torch.device("cpu"), torch.device("cuda", torch.cuda.current_device())):
        model = Transformer(dim=40).to(device)  # 40: uneven chunks, so some entries have padding
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        weights = seen.setdefault(device.type, [])
        for block in model.layers:
            block.register_forward_pre_hook(lambda m, args: weights.extend(
                p.detach().cpu().clone() for p in m.parameters()))
        inputs, _ = make_batch(0, 0, device=device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
            fused = [all(child.name != "aten::copy_" for child in evt.cpu_children)
                     for evt in prof.events() if evt.name == "aten::split_with_sizes_copy"]
    same = len(seen["cpu"]) == len(seen["cuda"]) and all(
        torch.equal(a, b) for a, b in zip(seen["cpu"], seen["cuda"]))
    return {"same_weights": same, "copy_outs": len(fused), "all_fused": all(fused)}


@needs_a_gpu
def test_cuda_copy_out_is_one_fused_kernel_with_the_cpus_result():
    """The flat copy-out hands torch's ``split_with_sizes_copy`` dense rows (headers to a
    scratch column, padding to dense scratch pieces): CUDA runs it as one kernel per group
    instead of one copy per parameter, and the unsharded weights are the CPU's, byte for byte."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fake_world, args=("_copy_out_on_both_devices", 4, results), nprocs=1)
        result = results[0]
    assert result["same_weights"], result
    assert result["copy_outs"] >= 3 and result["all_fused"], result
