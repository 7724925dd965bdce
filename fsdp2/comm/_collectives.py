"""A group's collectives: one all-gather of bytes, one reduce-scatter per dtype.

Two transports share the schedule (``_group.py``) and these entry points:

* **flat** (NCCL, any accelerator): one ``all_gather_into_tensor`` of every rank's
  slice into a rank-major output, then one foreach copy-out into the unsharded
  buffer; gradients are copied into a rank-major buffer for one
  ``reduce_scatter_tensor``. Runs on side streams (``_streams.py``).
* **exchange** (CPU, gloo): point-to-point messages straight from where each chunk
  lives to where it is needed, no flat buffer in between (``_exchange.py``).

All-gather moves bytes, so parameters of different dtypes (fp32 next to bf16,
as LoRA adapters often are) travel in one collective; each parameter's bytes
start at a 16-byte aligned offset so they can be viewed back as their dtype.
Reduce-scatter does arithmetic, so it runs once per reduce dtype present.

Layouts (for ``R`` ranks, each contributing a slice of ``S`` bytes):

* send slice and flat all-gather output, rank-major: ``[rank0: hdr p0 p1 ...][rank1: hdr p0 p1 ...]``;
  ``hdr`` is a 16-byte header naming what the rank gathers (checked in ``_checks.py``;
  the exchange sends it as a message of its own)
* unsharded buffer, parameter-major: ``[p0: padded full][p1: padded full] ...``
  so that each unsharded parameter is a plain view of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..diagnostics import _checks, _debug, _trace
from .cpu import _cma, _exchange, _pipes
from .. import _compat
from ..diagnostics._checks import HEADER
from ._comm import DEFAULT_ALL_GATHER, DEFAULT_REDUCE_SCATTER, AllGather, ReduceScatter
from ..runtime._param import ShardedParam, ShardLayout
from ._streams import Completion, streams_for

__all__ = [
    "ALIGN", "EXCHANGE_MIN_BYTES", "GatherPlan", "cpu_transport", "exchanges", "may_read", "probe_reads", "AllGatherInFlight", "ReduceScatterInFlight", "start_all_gather",
    "exchange_all_gather", "GatherTargets", "finish_all_gather", "copy_out", "ReduceTarget", "start_reduce_scatter",
    "finish_reduce_scatter", "ReducedGrads",
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
        return cls(tuple(layouts), tuple(dtypes), tuple(HEADER + o for o in offsets), HEADER + total)

    @property
    def world(self) -> int:
        return self.layouts[0].world

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in a rank's slice ``buffer``, typed and shaped ``local_shape``."""
        return self.slots(buffer)[i]

    def slots(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's place in a rank's slice ``buffer`` (``slice_bytes`` bytes)."""
        return self._views(buffer, 1)

    def rank_major(self, output: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's chunks in a flat all-gather ``output``, each ``(world, *local_shape)``."""
        return self._views(output, self.world)

    def _views(self, buffer: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        # One typed view of the bytes per dtype, then one as_strided per parameter: the views
        # are made for every parameter at every collective, so they take as few ops as can be.
        typed = {dtype: buffer.view(dtype) for dtype in self._dtype_set}
        views = []
        for dtype, shape, stride, offset in self._specs:
            base = typed[dtype]
            size, strides = ((ranks, *shape), (self.slice_bytes // dtype.itemsize, *stride)) if ranks > 1 \
                else (shape, stride)
            views.append(base.as_strided(size, strides, base.storage_offset() + offset))
        return views

    @cached_property
    def _specs(self) -> tuple[tuple[torch.dtype, torch.Size, tuple[int, ...], int], ...]:
        """(dtype, local shape, its contiguous stride, offset in elements of dtype) per parameter."""
        return tuple((dtype, lay.local_shape, lay.local_stride, off // dtype.itemsize)
                     for lay, dtype, off in zip(self.layouts, self.dtypes, self.offsets))

    @cached_property
    def _dtype_set(self) -> frozenset[torch.dtype]:
        return frozenset(self.dtypes)


CPU_COLLECTIVES_ENV = "FSDP2_CPU_COLLECTIVES"
CPU_TRANSPORTS = ("auto", "read", "exchange", "flat")
# Below this many unsharded bytes a group's exchange costs more than gloo's flat collective:
# each point-to-point message costs ~0.2 ms to post on gloo, whatever its size, while the
# flat collective's extra copies and slower transfer grow with the bytes. Measured on the
# 2-core development machine, 2 ranks, one unshard + reshard: 0.5 MiB flat 1.7 ms, exchange
# 2.4 ms; 2 MiB flat 3.4 ms, exchange 2.9 ms; 18 MiB flat 27 ms, exchange 10 ms.
EXCHANGE_MIN_BYTES = 2**20


def cpu_transport() -> str:
    """``FSDP2_CPU_COLLECTIVES``, checked: ``auto`` (the default), ``read``, ``exchange`` or ``flat``."""
    choice = os.environ.get(CPU_COLLECTIVES_ENV, "auto")
    if choice not in CPU_TRANSPORTS:
        raise ValueError(f"{CPU_COLLECTIVES_ENV}={choice!r}: use 'auto' (the default), 'read', 'exchange' or 'flat'")
    return choice


def exchanges(device: torch.device, unsharded_bytes: int) -> bool:
    """Whether a group's collectives run as point-to-point exchanges (``_exchange.py``).

    On CPU (gloo) they do for groups of at least ``EXCHANGE_MIN_BYTES`` unsharded bytes:
    faster than gloo's flat collectives there, and with no flat buffer to copy through.
    Smaller CPU groups, and every group on an accelerator (NCCL), use the flat collectives.
    ``FSDP2_CPU_COLLECTIVES`` overrides this for CPU groups built afterwards: ``auto`` (the
    default), ``read`` or ``exchange`` (always), or ``flat`` (never: the path NCCL takes,
    which runs on gloo too, so the tests cover it without a GPU).
    """
    choice = cpu_transport()
    if device.type != "cpu" or choice == "flat":
        return False
    return choice in ("read", "exchange") or unsharded_bytes >= EXCHANGE_MIN_BYTES


def may_read(device: torch.device) -> bool:
    """Whether an exchange group built now reads its peers' memory where the ranks allow it
    (``_cma.py``): unless ``FSDP2_CPU_COLLECTIVES=exchange`` asks for messages only."""
    return device.type == "cpu" and cpu_transport() in ("auto", "read")


def probe_reads(pg: dist.ProcessGroup) -> bool:
    """Find out (once, collectively) whether the ranks of ``pg`` can read each other's memory.

    ``FSDP2_CPU_COLLECTIVES=read`` makes a "no" an error instead of a fall-back to messages.
    """
    if _cma.probe(pg):
        _pipes.connect(pg)  # their small messages then skip gloo too
        return True
    if cpu_transport() != "read":
        return False
    raise RuntimeError(
        f"{CPU_COLLECTIVES_ENV}=read: the ranks {dist.get_process_group_ranks(pg)} cannot read each "
        "other's memory with process_vm_readv (different hosts or PID namespaces, ptrace "
        "restrictions, or a seccomp filter); use 'auto' to fall back to messages"
    )


class AllGatherInFlight(NamedTuple):
    """An all-gather issued but maybe not finished; finish it with :func:`finish_all_gather`.

    Flat: ``output`` receives every rank's slice (rank-major), copied out at the end.
    Exchange: the chunks land in the unsharded buffer itself; ``exchange`` has the rest.
    Every tensor here must outlive ``done``.
    """

    done: Completion
    plan: GatherPlan
    headers: torch.Tensor  # (world, HEADER) bytes: every rank's schedule header, once done
    send: torch.Tensor | None = None
    output: torch.Tensor | None = None
    exchange: _exchange.ExchangeAllGather | None = None
    headers_done: Completion | None = None  # exchange: the headers arrive first, checked before the rest

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (send buffers included, even when they are the shards)."""
        if self.exchange is not None:
            return self.exchange.buffers()
        return [t for t in (self.send, self.output) if t is not None]

    @property
    def release(self) -> _exchange.Exchange | None:
        """Read all-gathers: what is left once ``done``, the peers' acknowledgements.

        The peers read this rank's chunks out of its unsharded buffer, maybe after this
        rank's own wait returned: wait for this (and keep every tensor here alive) before
        that buffer is freed or refilled. None for the other transports (``done`` is all).
        """
        reads = self.exchange.exchange if self.exchange is not None else None
        return reads.release if isinstance(reads, _exchange.ReadExchange) and reads.defer else None


def start_all_gather(
    send: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup, device: torch.device,
    copied: Completion | None = None, header: torch.Tensor | None = None, comm: AllGather = DEFAULT_ALL_GATHER,
) -> AllGatherInFlight:
    """Issue the flat all-gather of ``send`` (after ``copied``, the copy-in that filled it, if any).

    ``header``, if given, is stamped into the first 16 bytes of ``send`` first. ``comm``
    allocates the output and runs the collective (``_comm.py``).
    """
    streams = streams_for(device)
    if header is not None:
        send[:HEADER].copy_(header, non_blocking=True)
    if plan.world == 1:  # nothing to gather: the send buffer is the result
        return AllGatherInFlight(copied or Completion(), plan, send[None, :HEADER], send, send)
    with streams.side("all_gather"):
        streams.after(copied)
        output = comm.allocate((plan.world * plan.slice_bytes,), dtype=torch.uint8, device=device)
        work = comm(output, send, group, async_op=True)
        done = streams.issued(work)
    headers = output.view(plan.world, plan.slice_bytes)[:, :HEADER]
    return AllGatherInFlight(done, plan, headers, send, output)


def exchange_all_gather(
    sources: Sequence[torch.Tensor], plan: GatherPlan, group: dist.ProcessGroup,
    chunks: Sequence[torch.Tensor], header: torch.Tensor | None, label: str, read: bool = False,
) -> AllGatherInFlight:
    """Issue the all-gather as an exchange straight into ``chunks`` (the unsharded buffer).

    ``sources``: this rank's shard of each parameter; ``chunks[i]``: parameter ``i``'s
    padded full tensor in the unsharded buffer, viewed ``(world, *local_shape)``
    (``ShardLayout.chunks_view``); ``label``: the group's, the same on every rank;
    ``read``: the peers read this rank's chunks (``_cma.py``).
    """
    if header is None:
        header = torch.zeros(HEADER, dtype=torch.uint8)
    gather = _exchange.start_all_gather(sources, chunks, header.view(torch.uint8), group,
                                        key=f"all_gather {label} {plan.world}", read=read)
    return AllGatherInFlight(Completion(work=gather.exchange), plan, gather.headers, exchange=gather,
                             headers_done=Completion(work=gather.header_exchange))


class GatherTargets:
    """Where one all-gather's entries go in a group's unsharded buffer; made once per world
    (the views outlive the buffer's frees, see ``ParamGroup._targets``).

    ``chunks[i]``: entry ``i``'s padded full tensor viewed ``(world, *local_shape)``
    (``ShardLayout.chunks_view``), where the exchange receives and the flat copy-out writes.
    """

    def __init__(self, plan: GatherPlan, chunks: list[torch.Tensor]) -> None:
        self.plan = plan
        self.chunks = chunks

    @cached_property
    def split(self) -> tuple[list[int], list[torch.Tensor]] | None:
        """The flat copy-out as one ``split_with_sizes_copy`` of a rank's slice after its header:
        the byte sizes in order (each entry, then its alignment padding where it has some) and
        where each goes (the entry's chunks as bytes; a scratch column for padding). None where
        an entry's chunks are not one block of memory each (``Shard(d)`` with ``d != 0``)."""
        with torch.inference_mode(False):  # written outside inference mode too: no inference views
            return self._split()

    def _split(self) -> tuple[list[int], list[torch.Tensor]] | None:
        chunks, plan = self.chunks, self.plan
        if not all(c.is_contiguous() for c in chunks):
            return None
        world = plan.world
        ends = [*plan.offsets[1:], plan.slice_bytes]
        sizes: list[int] = []
        places: list[torch.Tensor | None] = []  # None: padding, copied to scratch
        for chunk, start, end in zip(chunks, plan.offsets, ends):
            data = chunk.numel() // world * chunk.element_size()
            sizes.append(data)
            places.append(chunk.view(world, -1).view(torch.uint8))
            if end - start > data:
                sizes.append(end - start - data)
                places.append(None)
        pads = [size for size, place in zip(sizes, places) if place is None]
        scratch = iter(torch.empty(world, sum(pads), dtype=torch.uint8, device=chunks[0].device).split(pads, dim=1)
                       if pads else ())
        return sizes, [next(scratch) if place is None else place for place in places]


def finish_all_gather(inflight: AllGatherInFlight, targets: GatherTargets) -> None:
    """After the wait: put the gathered parameters in place in ``targets`` (the unsharded buffer)."""
    if inflight.exchange is not None:
        inflight.exchange.finish()
    else:
        copy_out(inflight, targets)


def copy_out(inflight: AllGatherInFlight, targets: GatherTargets) -> None:
    """Scatter the rank-major gathered bytes into the parameter-major unsharded buffer.

    One op for the whole group: a ``split_with_sizes_copy`` of the output's byte columns
    (no view per parameter per step), else one foreach copy of per-entry views.
    """
    plan = inflight.plan
    split = targets.split
    with torch.no_grad():
        if split is not None:
            rows = inflight.output.view(plan.world, plan.slice_bytes)[:, HEADER:]
            torch.split_with_sizes_copy(rows, split[0], dim=1, out=split[1])
        else:
            torch._foreach_copy_(targets.chunks, plan.rank_major(inflight.output))


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
    exchange: bool = False  # reduce by point-to-point exchange (CPU), not a flat collective
    read: bool = False  # the exchange reads peers' memory (``_cma.py``) instead of sending messages
    force_sum: bool = False  # SUM then divide, never the backend's AVG (set_force_sum_reduction_for_comms)
    hook: Any = None  # set_all_reduce_hook: (fn, stream or None), run on each finished reduction
    comm: ReduceScatter = DEFAULT_REDUCE_SCATTER  # the flat transport's allocator and collective (_comm.py)


class ReduceScatterInFlight(NamedTuple):
    """One dtype bucket's reduce-scatter, finished by :func:`finish_reduce_scatter`.

    Flat: ``output`` is this rank's reduced chunk once ``done``; ``held`` keeps the send
    buffer and, on CUDA, the unsharded gradients copied into it (the copy runs on the
    reduce-scatter stream while the compute stream could otherwise reuse their memory).
    Exchange: ``exchange`` sums the chunks received at the end and holds the gradients
    it sends from.
    """

    done: Completion
    params: tuple[ShardedParam, ...]
    offsets: tuple[int, ...]
    op: dist.ReduceOp
    post_divide: float | None
    target: ReduceTarget
    output: torch.Tensor | None = None
    held: tuple[torch.Tensor, ...] = ()
    exchange: _exchange.ExchangeReduceScatter | None = None

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (not the unsharded gradients it reads)."""
        if self.exchange is not None:
            return self.exchange.buffers()
        return [self.held[0], self.output]


def _reduce_op(dtype: torch.dtype, world: int, factor: float,
               force_sum: bool = False) -> tuple[dist.ReduceOp, float | None, float | None]:
    """(op, pre-divide, post-divide) averaging over ``factor``.

    fp32/bf16 use the backend's AVG when dividing by the world size (unless
    ``force_sum``); fp16 and other dtypes sum with the division split before and
    after (about sqrt(factor) each) to stay clear of overflow and underflow.
    """
    if world == 1:
        return dist.ReduceOp.SUM, None, (factor if factor != 1 else None)
    if dtype in (torch.float32, torch.bfloat16):
        if factor == world and not force_sum:
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
    header: torch.Tensor | None = None,
) -> ReduceScatterInFlight:
    """Issue the reduce-scatter of the full gradients ``grads`` (an exchange on CPU).

    Flat: a ``grads`` list is emptied once the gradients are copied into the send buffer, so
    that, the caller holding no other reference, they are freed before the output is allocated.

    ``header``: 16 bytes naming what this rank reduces (``_checks.reduce_header``); the
    exchange sends it ahead of the data and the ranks compare theirs when finishing.
    """
    world, group = target.world, target.group
    offsets, total = _offsets([p.layout.local_numel for p in params], align=False)
    op, pre, post = _reduce_op(dtype, world * target.replicate_world, target.divide_factor, target.force_sum)
    if world > 1:
        _debug.log_collective("reduce_scatter", target.label, group, f"{world} x {total} elements", dtype,
                              target.root)
    if target.exchange and world > 1:
        if header is None:
            header = torch.zeros(HEADER, dtype=torch.uint8)
        return _exchange_reduce_scatter(params, grads, dtype, target, op, pre, post, header)
    streams = streams_for(device)
    with streams.side("reduce_scatter"):
        comm = target.comm
        send = comm.allocate((world * total,), dtype=dtype, device=device)
        _copy_rank_major(send.view(world, total), params, grads, offsets)
        held_grads = tuple(grads) if streams.cuda else ()
        if isinstance(grads, list):  # the caller's list: the gradients are freed before the output exists
            grads.clear()
        if pre is not None and pre != 1:
            send.div_(pre)
        if world == 1:  # nothing to scatter: the send buffer is the result
            output, work = send, None
        else:
            output = comm.allocate((total,), dtype=dtype, device=device)
            work = comm(output, send, group, op, async_op=True)
        done = streams.issued(work)
    # CUDA: the copy-in ran on the reduce-scatter stream; hold the full gradients until the
    # compute stream waited on it. CPU: copied already, freed (``grads`` emptied) above.
    held = (send, *held_grads)
    return ReduceScatterInFlight(done, tuple(params), tuple(offsets), op, post, target, output, held)


def _exchange_reduce_scatter(
    params: Sequence[ShardedParam], grads: Sequence[torch.Tensor], dtype: torch.dtype, target: ReduceTarget,
    op: dist.ReduceOp, pre: float | None, post: float | None, header: torch.Tensor,
) -> ReduceScatterInFlight:
    """Send each gradient's chunks from where they are: copies only to cast, pad or pre-divide."""
    world = target.world
    predivide = pre is not None and pre != 1
    full, copies = [], []
    with torch.no_grad():
        for p, grad in zip(params, grads):
            lay = p.layout
            even = lay.shape[lay.dim] == lay.chunk * world
            if grad.dtype == dtype and grad.is_contiguous() and even and not predivide:
                full.append(grad)
                continue
            if even:
                copy = grad.to(dtype, memory_format=torch.contiguous_format, copy=True)
            else:
                copy = torch.zeros(lay.padded_shape, dtype=dtype, device=grad.device)
                copy.narrow(lay.dim, 0, lay.shape[lay.dim]).copy_(grad)
            full.append(copy)
            copies.append(copy)
        if predivide:
            torch._foreach_div_(full, pre)
    if op == dist.ReduceOp.AVG:  # the exchange sums; the average over this axis is a division
        post = float(world) * (post or 1.0)
    chunks = [p.layout.chunks_view(t) for p, t in zip(params, full)]
    rs = _exchange.start_reduce_scatter(chunks, full, copies, dtype, header, target.group,
                                        key=f"reduce_scatter {target.label} {dtype}", read=target.read)
    return ReduceScatterInFlight(Completion(work=rs.exchange), tuple(params), rs.offsets, op, post, target,
                                 exchange=rs)


def _run_all_reduce_hook(fn: Callable[[torch.Tensor], None], stream: Any, reduced: torch.Tensor) -> None:
    """``fn(reduced)`` (in place), on ``stream`` when one was given (CUDA), ordered both ways."""
    if stream is None:
        fn(reduced)
        return
    current = torch.cuda.current_stream(reduced.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn(reduced)
    current.wait_stream(stream)


def _copy_rank_major(by_rank: torch.Tensor, params: Sequence[ShardedParam], grads: Sequence[torch.Tensor],
                     offsets: Sequence[int]) -> None:
    """Copy each full gradient's chunk ``r`` into row ``r`` of ``by_rank`` (world, total)."""
    world = by_rank.shape[0]
    if all(p.layout.dim == 0 and p.layout.local_numel for p in params):  # the usual case: one op
        with torch.no_grad():
            _compat.chunk_cat(list(grads), world, by_rank)
        return
    targets, sources = [], []  # even shards: one foreach copy for all of them
    with torch.no_grad():
        for p, grad, off in zip(params, grads, offsets):
            lay = p.layout
            dst = by_rank.as_strided((world, *lay.local_shape), (by_rank.stride(0), *lay.local_stride),
                                     by_rank.storage_offset() + off)
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


class ReducedGrads(NamedTuple):
    """A finished reduce-scatter's work left on the all-reduce stream (CUDA), landed by :meth:`land`.

    ``done``: the all-reduce stream's completion (all-reduce, post-divide, accumulation
    into ``.grad``, offload copies). ``keep``: the buffers that stream reads, alive until
    the compute stream has waited on ``done``. ``deferred``: CPU-offloaded gradient shards
    copied to pinned host memory without blocking, added into ``.grad`` (and their hooks
    run) once the host has seen the copies land.
    """

    done: Completion
    keep: tuple[torch.Tensor, ...]
    deferred: tuple[tuple[ShardedParam, torch.Tensor], ...]

    def land(self) -> None:
        """Order the compute stream (and, for offloaded gradients, the host) after the work."""
        self.done.wait()
        if self.deferred:
            self.done.wait_host()  # the host adds into (and the optimizer reads) host memory
            for p, staged in self.deferred:
                p.add_sharded_grad(staged)
                p.run_sharded_grad_hooks()


def _stage_to_host(p: ShardedParam, shard: torch.Tensor) -> torch.Tensor:
    """CUDA, CPU offload: ``shard`` copied (cast to the parameter's dtype) into host memory,
    pinned and without blocking where the parameter is pinned; the copy lands with the stream."""
    staged = torch.empty(shard.shape, dtype=p.orig_dtype, device="cpu", pin_memory=p.pin_memory)
    staged.copy_(shard, non_blocking=p.pin_memory)
    return staged


def finish_reduce_scatter(inflight: ReduceScatterInFlight) -> ReducedGrads | None:
    """Wait, all-reduce across replicas (HSDP), add each rank's chunk into the sharded ``.grad``,
    then run the sharded parameter's post-accumulate-grad hooks (none while HSDP defers its all-reduce).

    One path, two back-ends. CPU: in order on the calling thread, as the collectives'
    waits block it; returns None. CUDA: the compute stream waits for the reduce-scatter
    only (its input, the unsharded gradients, may then be freed); everything after it runs
    on the all-reduce stream, which the compute stream waits on only when it reads the
    results: before user hooks on the sharded parameters run, and at the end of backward
    (``ReducedGrads.land``, returned for the caller to keep). CPU-offloaded gradient
    shards go to host memory with non-blocking copies there, added once landed.
    """
    target = inflight.target
    sizes = f"{target.world} x {sum(p.layout.local_numel for p in inflight.params)} elements"
    if inflight.exchange is not None:  # the headers first: data that does not match may never come
        _debug.wait(inflight.exchange.header_exchange, "reduce_scatter", target.label, sizes, target.root)
        _checks.check_reduce_headers(target, inflight.exchange.headers)
    _debug.wait(inflight.done, "reduce_scatter", target.label, sizes, target.root)  # CUDA: the compute stream
    out = inflight.exchange.reduced() if inflight.exchange is not None else inflight.output
    streams = streams_for(out.device)
    deferred: list[tuple[ShardedParam, torch.Tensor]] = []
    with streams.side("all_reduce"):
        inflight.done.wait()  # CUDA: the all-reduce stream too (a second waiter)
        if not _reduce_across_replicas(inflight, out):
            return None  # HSDP with its all-reduce off: the sums wait in target.partial
        if inflight.post_divide is not None and inflight.post_divide != 1:
            out.div_(inflight.post_divide)
        if target.hook is not None:
            _run_all_reduce_hook(*target.hook, out)
        base = out.storage_offset()
        shards = [out.as_strided(p.layout.local_shape, p.layout.local_stride, base + off)
                  for p, off in zip(inflight.params, inflight.offsets)]
        if target.check_finite:
            _checks.record_nonfinite(target.root, inflight.params, shards)
        landed = []
        for p, shard in zip(inflight.params, shards):
            if streams.cuda and p.padded_local.device.type == "cpu":
                deferred.append((p, _stage_to_host(p, shard)))
            else:
                p.add_sharded_grad(shard)
                landed.append(p)
        done = streams.issued(None)
    if streams.cuda and any(_compat.has_post_accumulate_grad_hooks(p.sharded) for p in landed):
        done.wait()  # user hooks (e.g. an optimizer step per parameter) read .grad on the compute stream
    for p in landed:
        p.run_sharded_grad_hooks()  # the user's, e.g. an optimizer step per parameter
    _trace.emit("reduce_scatter_done", target.label, scheduled=False)
    if not streams.cuda:
        return None
    return ReducedGrads(done, (out,), tuple(deferred))


def _reduce_across_replicas(inflight: ReduceScatterInFlight, out: torch.Tensor) -> bool:
    """HSDP: all-reduce ``out`` over the replicas (with sums kept while the all-reduce was off).

    Returns False when the all-reduce is off this time: ``out`` then waits in ``target.partial``.
    """
    target = inflight.target
    if target.replicate_group is None:
        return True
    earlier = target.partial.pop(out.dtype, None)
    if earlier is not None:  # reduce-scattered while all-reduce was off
        out += earlier
    if not target.all_reduce:
        target.partial[out.dtype] = out
        return False
    _trace.emit("all_reduce", target.label)
    sizes = f"{out.numel()} elements over {target.replicate_world} replicas"
    _debug.log_collective("all_reduce", target.label, target.replicate_group, sizes, out.dtype, target.root)
    work = dist.all_reduce(out, op=inflight.op, group=target.replicate_group, async_op=True)
    _debug.wait(work, "all_reduce", target.label, sizes, target.root)  # CUDA: the all-reduce stream waits
    return True
