"""``calibrate``: this machine measured as a ``Hardware`` profile for the step-time model.

Every figure is timed on all ranks at once, one thread each, each loop timed as a whole (the
median of three loops), so ranks sharing cores (more ranks than cores, or other work) get what
each gets in training:

* compute: fp32 1024x1024 matmuls (``peak_flops``), a 64 MiB copy (``hbm_bandwidth``), a causal
  fused attention forward and backward (``attention_flops``); the matmuls again on the first
  rank alone, its peers idle (``oversubscription``: how much faster a rank runs while others
  idle, where ranks share cores with each other or with other work);
* host work, on a Llama of the planner's family at toy size (dim 32, 2 blocks: its roofline is
  negligible, what remains is eager execution's): one forward and backward plainly, with the
  blocks tensor-parallel (``fsdp2.models.llama.tp_plan`` over 2 ranks) and with every block and
  the root under ``fully_shard``; each time over the ops ``model_costs`` records for that model
  gives ``op_overhead`` and ``dtensor_op_overhead`` (per op as the step-time model counts them),
  the sharded run's excess over the plain one per group gives ``group_overhead``, and AdamW's
  step with the gradient clip over the sharded parameters, per tensor, ``param_overhead``;
* collectives: gloo all-reduces of one element (latency) and of ``comm_bytes`` (bandwidth),
  medians (a collective waits for its peers to be scheduled, as in training).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..models.llama import ModelArgs, tp_plan
from ._costs import _cached
from ._hardware import Hardware
from ._layout import ModelBuilder

__all__ = ["calibrate"]

# The toy Llama the host figures are timed on: two heads and two kv heads (tensor parallelism over 2).
_TOY = ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64, max_seq_len=16)


def _median(fn: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` timed runs (seconds): what a rank sharing its core gets, typically."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _loop(fn: Callable[[], object], repeats: int, windows: int = 3) -> float:
    """Seconds per run of ``repeats`` back-to-back runs, timed as a whole: with every rank running
    its loop at once, a rank sharing its core with others gets its share of it, waits included.
    The median of ``windows`` such loops: a burst of other work during one of them (a process
    exiting, the kernel's housekeeping) moves a single loop's figure by a quarter on a busy
    2-core host, and every prediction with it."""
    fn()
    per_run = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        per_run.append((time.perf_counter() - start) / repeats)
    return sorted(per_run)[len(per_run) // 2]


def _matmul_flops(n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _loop(lambda: torch.mm(a, b), 8)


def _copy_bandwidth(nbytes: int = 64 * 2**20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _loop(lambda: dst.copy_(src), 8)  # read once, written once


def _attention_flops(batch: int = 2, heads: int = 8, seq: int = 256, head_dim: int = 64) -> float:
    """FLOP/s of a causal fused attention's forward and backward, its FLOPs as ``model_costs``
    counts them (the unmasked half; backward 2.5x forward)."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    forward = 2 * batch * heads * seq * seq * 2 * head_dim * 0.5
    return 3.5 * forward / _loop(run, 8)


def _toy_model(builder: ModelBuilder) -> torch.nn.Module:
    model = builder.build()
    model.init_weights(seed=0)
    return model


def _step(model: torch.nn.Module, builder: ModelBuilder, inputs: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        builder.loss_fn(model(inputs), inputs).backward()
    return run


def _host_figures(group: dist.ProcessGroup, world: int, repeats: int = 6) -> tuple[float, float, float, float]:
    """(op, DTensor op, group, parameter) host overheads in seconds, timed on the toy Llama."""
    from .. import fully_shard
    from .._clip import clip_grad_norm_

    builder = ModelBuilder.llama(_TOY, built_blocks=_TOY.n_layers)
    seq = _TOY.max_seq_len
    costs = _cached(builder, seq, None)
    ops = _TOY.n_layers * (len(costs.block_forward) + len(costs.block_backward)) + \
        len(costs.rest_forward) + len(costs.rest_backward)
    inputs = builder.make_inputs(1, seq)

    def timed(model: torch.nn.Module) -> float:
        dist.barrier(group=group)
        return _loop(_step(model, builder, inputs), repeats)

    plain = timed(_toy_model(builder))
    tp_model = _toy_model(builder)
    tp_plan(tp_model, _tp_mesh(group, world))
    tensor_parallel = timed(tp_model)
    sharded = _toy_model(builder)
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in sharded.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    fsdp = timed(sharded)
    params = [p for p in sharded.parameters() if p.grad is not None]
    optimizer = torch.optim.AdamW(params, lr=1e-6)

    def update() -> None:
        clip_grad_norm_(params, 1.0)
        optimizer.step()

    dist.barrier(group=group)
    per_param = _loop(update, repeats) / len(params)
    groups = _TOY.n_layers + 1
    return plain / ops, tensor_parallel / ops, max(0.0, fsdp - plain) / groups, per_param


def _tp_mesh(group: dist.ProcessGroup, world: int) -> DeviceMesh:
    """Tensor parallelism over 2 ranks: a (world / 2, 2) mesh of the default group's ranks, or the
    given group whole where that cannot be built (an odd world, a group that is not the world)."""
    if world > 2 and world % 2 == 0 and group is dist.group.WORLD:
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    return DeviceMesh.from_group(group, "cpu")


def _collective(group: dist.ProcessGroup, nbytes: int) -> tuple[float, float]:
    """(bandwidth, latency per ring step) of all-reduces on ``group``, all its ranks calling.

    An all-reduce of B bytes on n ranks takes 2 (n - 1) / n x B / bandwidth + 2 (n - 1) x latency:
    a one-element one gives the latency, a large one the bandwidth. Every rank takes rank 0's figures.
    """
    n = dist.get_world_size(group)
    small, large = torch.zeros(1), torch.zeros(nbytes // 4)

    def timed(t: torch.Tensor, repeats: int) -> float:
        dist.barrier(group=group)
        return _median(lambda: dist.all_reduce(t, group=group), repeats)

    t_small, t_large = timed(small, 20), timed(large, 5)
    latency = t_small / (2 * (n - 1))
    bandwidth = 2 * (n - 1) / n * nbytes / max(t_large - 2 * (n - 1) * latency, 1e-9)
    figures = torch.tensor([bandwidth, latency], dtype=torch.float64)
    dist.broadcast(figures, src=dist.get_global_rank(group, 0), group=group)
    return float(figures[0]), float(figures[1])


def _measure(group: dist.ProcessGroup, nbytes: int) -> tuple[float, ...]:
    """(flops, memory bandwidth, attention flops, op, DTensor op, group and parameter overheads,
    oversubscription, link bandwidth, link latency), every rank of ``group`` calling; compute and host
    figures: the ranks' mean."""
    world = dist.get_world_size(group)
    bandwidth, latency = _collective(group, nbytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per rank, as the CPU training recipe runs them
    try:
        dist.barrier(group=group)
        local = torch.tensor([_matmul_flops(), _copy_bandwidth(), _attention_flops(), *_host_figures(group, world)],
                             dtype=torch.float64)
        # The first rank alone, the others waiting in a barrier: how much faster a rank runs
        # while its peers idle (ranks sharing cores, with each other or with other work).
        alone = torch.tensor([_matmul_flops() if dist.get_rank(group) == 0 else 0.0], dtype=torch.float64)
        dist.barrier(group=group)
    finally:
        torch.set_num_threads(threads)
    dist.all_reduce(local, group=group)
    local /= world
    dist.broadcast(alone, src=dist.get_global_rank(group, 0), group=group)
    oversubscription = min(float(world), max(1.0, float(alone[0]) / float(local[0])))
    return (*(float(x) for x in local), oversubscription, bandwidth, latency)


def _rank(rank: int, world: int, store_path: str, nbytes: int, out: object) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        figures = _measure(dist.group.WORLD, nbytes)
        if rank == 0:
            out.put(figures)  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def _spawned(world: int, nbytes: int, timeout: float) -> tuple[float, ...]:
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, nbytes, out), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while True:  # a rank that dies ends the wait (its traceback is on stderr)
                try:
                    figures = out.get(timeout=1.0)
                    break
                except queue.Empty:
                    failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if failed or time.monotonic() > deadline:
                        why = f"rank {failed[0]} exited with {procs[failed[0]].exitcode}" if failed else \
                            f"no figures after {timeout:.0f} s"
                        raise RuntimeError(f"calibrate: {why}; run it under `if __name__ == '__main__':` "
                                           "(its ranks are spawned processes that import the main module)") from None
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return figures


def calibrate(*, world: int = 2, group: dist.ProcessGroup | None = None, comm_bytes: int = 16 * 2**20,
              timeout: float = 300.0, name: str | None = None) -> Hardware:
    """Measure this machine: a ``Hardware`` profile whose figures are what it reaches (efficiencies 1).

    What is timed, and how, is this module's docstring: compute, host overheads (per op, per op
    of a tensor-parallel block, per FSDP group, per parameter tensor of the optimizer step) and
    collectives, on ``world`` local processes it spawns (gloo), or on ``group`` when given (then
    every rank of it must call, all get the same figures, and tensor parallelism is timed over
    the whole group unless it is the default group of an even world). One host:
    ``devices_per_node`` is the ranks measured and the inter-node figures are the intra-node
    ones. ``memory``: the host's RAM divided by those ranks; ``oversubscription``: the first
    rank's matmul speed alone (the others waiting) over the ranks' mean with all busy, between 1
    and the ranks measured.

    Args:
        world: ranks to spawn (at least 2); ignored with ``group``.
        group: an existing gloo process group to measure instead of spawning.
        comm_bytes: bytes of the large all-reduce.
        timeout: seconds to wait for the spawned ranks.
        name: the profile's name (default: "calibrated: <world> CPU ranks").
    """
    if group is None and (not isinstance(world, int) or isinstance(world, bool) or world < 2):
        raise ValueError(f"calibrate(world=...) must be an int >= 2 (ranks whose collectives are timed), got {world!r}")
    if group is not None:
        world = dist.get_world_size(group)
        figures = _measure(group, comm_bytes)
    else:
        figures = _spawned(world, comm_bytes, timeout)
    flops, hbm, attention, op, dtensor_op, group_op, param_op, oversubscription, bandwidth, latency = figures
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name=name or f"calibrated: {world} CPU ranks", peak_flops=flops, hbm_bandwidth=hbm,
                    devices_per_node=world, intra_bandwidth=bandwidth, intra_latency=latency,
                    inter_bandwidth=bandwidth, inter_latency=latency, memory=max(1, ram // world),
                    flops_efficiency=1.0, bandwidth_efficiency=1.0, link_efficiency=1.0, op_overhead=op,
                    dtensor_op_overhead=dtensor_op, group_overhead=group_op, param_overhead=param_op,
                    oversubscription=oversubscription, attention_flops=attention)
