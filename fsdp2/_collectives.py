"""Flat collectives for a group: one all-gather of bytes, one reduce-scatter per dtype.

All-gather moves bytes, so parameters of different dtypes (fp32 next to bf16,
as LoRA adapters often are) travel in one collective; each parameter's bytes
start at a 16-byte aligned offset so they can be viewed back as their dtype.
Reduce-scatter does arithmetic, so it runs once per reduce dtype present.

Layouts (for ``R`` ranks, each contributing a slice of ``S`` bytes):

* all-gather output, rank-major: ``[rank0: hdr p0 p1 ...][rank1: hdr p0 p1 ...]`` (collective's
  order); ``hdr`` is a 16-byte header naming what the rank gathers (checked in ``_checks.py``)
* unsharded buffer, parameter-major: ``[p0: padded full][p1: padded full] ...``
  so that each unsharded parameter is a plain view of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from . import _checks, _compat, _debug, _trace
from ._param import ShardedParam, ShardLayout
from ._streams import Completion, streams_for

__all__ = [
    "ALIGN", "GatherPlan", "AllGatherInFlight", "ReduceScatterInFlight",
    "start_all_gather", "copy_out", "ReduceTarget", "start_reduce_scatter", "finish_reduce_scatter",
]

ALIGN = 16  # bytes; a multiple of every dtype's itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _offsets(sizes: Sequence[int], align: bool) -> tuple[list[int], int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += _aligned(size) if align else size
    return offsets, total


@dataclass(frozen=True)
class GatherPlan:
    """Byte layout of one all-gather of a group over ``world`` ranks."""

    layouts: tuple[ShardLayout, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]  # of each parameter inside a rank's slice, after the header
    slice_bytes: int

    @classmethod
    def build(cls, layouts: Sequence[ShardLayout], dtypes: Sequence[torch.dtype]) -> GatherPlan:
        sizes = [lay.local_numel * dt.itemsize for lay, dt in zip(layouts, dtypes)]
        offsets, total = _offsets(sizes, align=True)
        header = _checks.HEADER
        return cls(tuple(layouts), tuple(dtypes), tuple(header + o for o in offsets), header + total)

    @property
    def world(self) -> int:
        return self.layouts[0].world

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in a rank's slice ``buffer``, typed and shaped ``local_shape``."""
        lay, dtype = self.layouts[i], self.dtypes[i]
        nbytes = lay.local_numel * dtype.itemsize
        return buffer[self.offsets[i]:self.offsets[i] + nbytes].view(dtype).view(lay.local_shape)


class AllGatherInFlight(NamedTuple):
    """An all-gather issued but maybe not finished; both buffers must outlive ``done``."""

    done: Completion
    send: torch.Tensor
    output: torch.Tensor
    plan: GatherPlan


def start_all_gather(
    send: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup, device: torch.device,
    copied: Completion | None = None,
) -> AllGatherInFlight:
    """Issue the all-gather of ``send`` (after ``copied``, the copy-in that filled it, if any)."""
    streams = streams_for(device)
    if plan.world == 1:  # nothing to gather: the send buffer is the result
        return AllGatherInFlight(copied or Completion(), send, send, plan)
    with streams.side("all_gather"):
        streams.after(copied)
        output = torch.empty(plan.world * plan.slice_bytes, dtype=torch.uint8, device=device)
        work = _compat.all_gather_flat(output, send, group=group, async_op=True)
        done = streams.issued(work)
    return AllGatherInFlight(done, send, output, plan)


def copy_out(inflight: AllGatherInFlight, regions: Sequence[torch.Tensor]) -> None:
    """Scatter the rank-major gathered bytes into parameter-major ``regions``.

    ``regions[i]`` is parameter ``i``'s padded full tensor (typed, shaped ``padded_shape``).
    """
    plan = inflight.plan
    by_rank = inflight.output.view(plan.world, plan.slice_bytes)
    sources, targets = [], []
    for i, region in enumerate(regions):
        lay, dtype = plan.layouts[i], plan.dtypes[i]
        nbytes = lay.local_numel * dtype.itemsize
        sources.append(by_rank[:, plan.offsets[i]:plan.offsets[i] + nbytes].view(dtype).unflatten(1, lay.local_shape))
        targets.append(lay.chunks_view(region))
    with torch.no_grad():
        torch._foreach_copy_(targets, sources)


@dataclass
class ReduceTarget:
    """Where and how one group's gradients are reduced.

    ``group``/``world``: the shard axis (reduce-scatter). ``replicate_group``:
    the replicate axis of an HSDP mesh (all-reduce after the reduce-scatter),
    skipped while ``all_reduce`` is False, in which case the reduce-scattered
    sums wait in ``partial`` (per dtype) for the next all-reduce.
    """

    group: dist.ProcessGroup
    world: int
    replicate_group: dist.ProcessGroup | None
    replicate_world: int
    all_reduce: bool
    partial: dict[torch.dtype, torch.Tensor]
    divide_factor: float
    label: str
    root: Any = None  # the root's RootContext: iteration and phase for diagnostics
    check_finite: bool = False  # record non-finite reduced gradients (set_check_finite_gradients)


class ReduceScatterInFlight(NamedTuple):
    """One dtype bucket's reduce-scatter, finished by :func:`finish_reduce_scatter`.

    ``grads`` (the unsharded gradients copied into ``input``) are held until then:
    on CUDA the copy runs on the reduce-scatter stream while the compute stream
    could otherwise reuse their memory.
    """

    done: Completion
    input: torch.Tensor
    output: torch.Tensor
    params: tuple[ShardedParam, ...]
    offsets: tuple[int, ...]
    op: dist.ReduceOp
    post_divide: float | None
    target: ReduceTarget
    grads: tuple[torch.Tensor, ...]


def _reduce_op(dtype: torch.dtype, world: int, factor: float) -> tuple[dist.ReduceOp, float | None, float | None]:
    """(op, pre-divide, post-divide) averaging over ``factor``.

    fp32/bf16 use the backend's AVG when dividing by the world size; fp16 and
    other dtypes sum with the division split before and after (about
    sqrt(factor) each) to stay clear of overflow and underflow.
    """
    if world == 1:
        return dist.ReduceOp.SUM, None, (factor if factor != 1 else None)
    if dtype in (torch.float32, torch.bfloat16):
        if factor == world:
            return dist.ReduceOp.AVG, None, None
        return dist.ReduceOp.SUM, None, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return dist.ReduceOp.SUM, float(pre), factor / pre


def start_reduce_scatter(
    params: Sequence[ShardedParam],
    grads: Sequence[torch.Tensor],
    dtype: torch.dtype,
    target: ReduceTarget,
    device: torch.device,
) -> ReduceScatterInFlight:
    """Copy full gradients into one rank-major buffer and issue the reduce-scatter."""
    world, group = target.world, target.group
    offsets, total = _offsets([p.layout.local_numel for p in params], align=False)
    op, pre, post = _reduce_op(dtype, world * target.replicate_world, target.divide_factor)
    streams = streams_for(device)
    with streams.side("reduce_scatter"):
        send = torch.empty(world * total, dtype=dtype, device=device)
        _copy_rank_major(send.view(world, total), params, grads, offsets)
        if pre is not None and pre != 1:
            send.div_(pre)
        if world == 1:  # nothing to scatter: the send buffer is the result
            output, work = send, None
        else:
            output = torch.empty(total, dtype=dtype, device=device)
            _debug.log_collective("reduce_scatter", target.label, group, f"{world} x {total} elements", dtype,
                                  target.root)
            work = _compat.reduce_scatter_flat(output, send, op=op, group=group, async_op=True)
        done = streams.issued(work)
    # CUDA: the copy-in ran on the reduce-scatter stream; hold the full gradients until the
    # compute stream waited on it. CPU: copied already, free them now.
    held = tuple(grads) if streams.cuda else ()
    return ReduceScatterInFlight(done, send, output, tuple(params), tuple(offsets), op, post, target, held)


def _copy_rank_major(by_rank: torch.Tensor, params: Sequence[ShardedParam], grads: Sequence[torch.Tensor],
                     offsets: Sequence[int]) -> None:
    """Copy each full gradient's chunk ``r`` into row ``r`` of ``by_rank`` (world, total)."""
    world = by_rank.shape[0]
    targets, sources = [], []  # even shards: one foreach copy for all of them
    with torch.no_grad():
        for p, grad, off in zip(params, grads, offsets):
            lay = p.layout
            dst = by_rank[:, off:off + lay.local_numel].unflatten(1, lay.local_shape)
            if lay.shape[lay.dim] == lay.chunk * world:
                targets.append(dst)
                sources.append(lay.chunks_view(grad.contiguous()))
            else:  # uneven: zero the padding, then copy each rank's true rows
                dst.zero_()
                for r in range(world):
                    rows = lay.rows(r)
                    if rows:
                        dst[r].narrow(lay.dim, 0, rows).copy_(grad.narrow(lay.dim, r * lay.chunk, rows))
        if targets:
            torch._foreach_copy_(targets, sources)


def finish_reduce_scatter(inflight: ReduceScatterInFlight) -> None:
    """Wait, all-reduce across replicas (HSDP), add each rank's chunk into the sharded ``.grad``."""
    out, target = inflight.output, inflight.target
    _debug.wait(inflight.done, "reduce_scatter", target.label,
                f"{target.world} x {out.numel()} {out.dtype} elements", target.root)
    if target.replicate_group is not None:
        earlier = target.partial.pop(out.dtype, None)
        if earlier is not None:  # reduce-scattered while all-reduce was off
            out += earlier
        if not target.all_reduce:
            target.partial[out.dtype] = out
            return
        _trace.emit("all_reduce", target.label)
        sizes = f"{out.numel()} elements over {target.replicate_world} replicas"
        _debug.log_collective("all_reduce", target.label, target.replicate_group, sizes, out.dtype, target.root)
        work = dist.all_reduce(out, op=inflight.op, group=target.replicate_group, async_op=True)
        _debug.wait(work, "all_reduce", target.label, sizes, target.root)
    if inflight.post_divide is not None and inflight.post_divide != 1:
        out.div_(inflight.post_divide)
    shards = [out[off:off + p.layout.local_numel].view(p.layout.local_shape)
              for p, off in zip(inflight.params, inflight.offsets)]
    if target.check_finite:
        _checks.record_nonfinite(target.root, inflight.params, shards)
    for p, shard in zip(inflight.params, shards):
        p.add_sharded_grad(shard)
