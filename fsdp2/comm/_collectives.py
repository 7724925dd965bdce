"""What every transport shares: the all-gather's byte layout, the collectives in flight, and
finishing a reduction (HSDP all-reduce, division, accumulation into ``.grad``).

All-gather moves bytes, so parameters of different dtypes (fp32 next to bf16,
as LoRA adapters often are) travel in one collective; each parameter's bytes
start at a 16-byte aligned offset so they can be viewed back as their dtype.
Reduce-scatter does arithmetic, so it runs once per reduce dtype present.

Layouts (for ``R`` ranks, each contributing a slice of ``S`` bytes):

* send slice and flat all-gather output, rank-major: ``[rank0: hdr p0 p1 ...][rank1: hdr p0 p1 ...]``;
  ``hdr`` is a 16-byte header naming what the rank gathers (checked in ``diagnostics/_checks.py``;
  the exchange sends it as a message of its own)
* unsharded buffer, parameter-major: ``[p0: padded full][p1: padded full] ...``
  so that each unsharded parameter is a plain view of it.

How the bytes move is the transport's (``_transport.py``): flat collectives (``_flat.py``)
or CPU exchanges (``cpu/``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .. import _compat
from .._format import HEADER, aligned
from ..diagnostics import _checks, _debug, _trace
from ._streams import Completion, streams_for

if TYPE_CHECKING:
    from ..runtime._layout import ShardLayout
    from ..runtime._param import ShardedParam
    from ._transport import Transport

__all__ = [
    "GatherPlan", "GatherTargets", "AllGatherInFlight", "ReduceTarget", "ReduceScatterInFlight",
    "reduce_op", "packed_offsets", "finish_reduce_scatter", "ReducedGrads", "show_flat_all_gather",
    "show_flat_reduce_scatter",
]


def packed_offsets(sizes: Sequence[int], align: bool) -> tuple[list[int], int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += aligned(size) if align else size
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
        offsets, total = packed_offsets(sizes, align=True)
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


class AllGatherInFlight(NamedTuple):
    """An all-gather issued but maybe not finished; ``transport.finish_all_gather`` finishes it.

    Flat: ``output`` receives every rank's slice (rank-major), copied out at the end.
    Exchange: the chunks land in the unsharded buffer itself; ``exchange`` has the rest
    (``headers_done``: the headers arrive first, checked before the rest).
    Every tensor here must outlive ``done``.
    """

    done: Completion
    plan: GatherPlan
    headers: torch.Tensor | None  # (world, HEADER) bytes: the ranks' schedule headers, once done; None: unchecked
    transport: Transport
    send: torch.Tensor | None = None
    output: torch.Tensor | None = None
    exchange: Any = None  # the CPU transport's in-flight exchange (cpu/_exchange.ExchangeAllGather)
    headers_done: Completion | None = None
    # What must finish, once ``done``, before the unsharded buffer is freed or refilled (the
    # peers of a read exchange read this rank's chunks out of it, maybe after this rank's own
    # wait returned): ``wait()`` it, keeping every tensor here alive. None: ``done`` is all.
    release: Any = None

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (send buffers included, even when they are the shards)."""
        if self.exchange is not None:
            return self.exchange.buffers()
        return [t for t in (self.send, self.output) if t is not None]


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
    force_sum: bool = False  # SUM then divide, never the backend's AVG (set_force_sum_reduction_for_comms)
    hook: Any = None  # set_all_reduce_hook: (fn, stream or None), run on each finished reduction


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
    exchange: Any = None  # the CPU transport's in-flight exchange (cpu/_exchange.ExchangeReduceScatter)

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (not the unsharded gradients it reads)."""
        if self.exchange is not None:
            return self.exchange.buffers()
        return [self.held[0], self.output]


def reduce_op(dtype: torch.dtype, world: int, factor: float,
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
    pre = _divide_before(factor)
    return dist.ReduceOp.SUM, pre, factor / pre


def _divide_before(factor: float) -> float:
    """The part of ``factor`` to divide by before summing (the rest divides after): the first
    power of two that no longer divides ``factor`` exactly or whose square reaches it, so each
    part is about ``sqrt(factor)`` and the sum of pre-divided values stays in fp16's range."""
    powers = (1 << k for k in itertools.count())
    return float(next(p for p in powers if factor % p or p * p >= factor))


def show_flat_all_gather(plan: GatherPlan, pg: dist.ProcessGroup) -> None:
    """Under a dispatch mode (``CommDebugMode``): the flat all-gather a transport's messages or
    reads stand for, issued on meta tensors of its shapes, so the mode sees the collective
    torch's FSDP2 (and fsdp2's flat transport) issues. Meta tensors move no data: c10d's meta
    kernel returns at once, on this rank alone, whatever the others do. Without a mode, or on
    one rank (no collective there, as with the flat transport and torch), nothing.
    """
    if plan.world > 1 and _compat.dispatch_modes_active():
        meta = torch.device("meta")
        send = torch.empty(plan.slice_bytes, dtype=torch.uint8, device=meta)
        out = torch.empty(plan.world * plan.slice_bytes, dtype=torch.uint8, device=meta)
        _compat.all_gather_flat(out, send, group=pg)


def show_flat_reduce_scatter(numel: int, world: int, dtype: torch.dtype, op: dist.ReduceOp,
                             pg: dist.ProcessGroup) -> None:
    """As :func:`show_flat_all_gather`, for a reduce-scatter of ``numel`` elements per rank."""
    if _compat.dispatch_modes_active():
        meta = torch.device("meta")
        out = torch.empty(numel, dtype=dtype, device=meta)
        _compat.reduce_scatter_flat(out, torch.empty(world * numel, dtype=dtype, device=meta), op=op, group=pg)


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


class ReducedGrads(NamedTuple):
    """What a finished reduce-scatter left on the all-reduce stage, on either back-end.

    ``done``: the stage's completion (all-reduce, post-divide, accumulation into ``.grad``,
    offload copies). ``keep``: every buffer the stage reads or writes: the reduce-scatter's
    output and the partial sums of steps without all-reduce that it added in; on CUDA the
    caller holds them until the compute stream has waited on ``done`` (:meth:`land`), or the
    caching allocator could hand their blocks to the next reduce-scatter while the all-reduce
    stream still reads them. ``deferred``: CPU-offloaded gradient shards copied to pinned
    host memory without blocking, added into ``.grad`` (and their hooks run) once the host
    has seen the copies land. On CPU the stage ran on the calling thread: nothing is
    ``outstanding``.
    """

    done: Completion
    keep: tuple[torch.Tensor, ...]
    deferred: tuple[tuple[ShardedParam, torch.Tensor], ...]

    @property
    def outstanding(self) -> bool:
        """Whether the caller must keep this until :meth:`land`: the stage may still be running
        (no stream waited on it yet) or offloaded gradients wait to be added."""
        return self.done.pending or bool(self.deferred)

    def land(self) -> None:
        """Order the compute stream (and, for offloaded gradients, the host) after the work."""
        self.done.wait()
        if self.deferred:
            self.done.wait_host()  # the host adds into (and the optimizer reads) host memory
            for p, staged in self.deferred:
                p.add_sharded_grad(staged)
                p.run_sharded_grad_hooks()


class _AcrossReplicas(NamedTuple):
    """What HSDP's step of the stage did with a reduce-scatter's output."""

    all_reduced: bool  # False: the output waits in ``target.partial`` for a later all-reduce
    read: tuple[torch.Tensor, ...]  # the earlier partial sums added into it (now the stage's to keep)


def _stage_to_host(p: ShardedParam, shard: torch.Tensor) -> torch.Tensor:
    """CUDA, CPU offload: ``shard`` copied (cast to the parameter's dtype) into host memory,
    pinned and without blocking where the parameter is pinned; the copy lands with the stream."""
    staged = torch.empty(shard.shape, dtype=p.orig_dtype, device="cpu", pin_memory=p.pin_memory)
    staged.copy_(shard, non_blocking=p.pin_memory)
    return staged


def finish_reduce_scatter(inflight: ReduceScatterInFlight) -> ReducedGrads:
    """Wait, all-reduce across replicas (HSDP), add each rank's chunk into the sharded ``.grad``,
    then run the sharded parameter's post-accumulate-grad hooks (none while HSDP defers its all-reduce).

    One path, two back-ends. CPU: in order on the calling thread, as the collectives'
    waits block it. CUDA: the compute stream waits for the reduce-scatter only (its input,
    the unsharded gradients, may then be freed); everything after it runs on the all-reduce
    stream, which the compute stream waits on only when it reads the results: before user
    hooks on the sharded parameters run, and at the end of backward (``ReducedGrads.land``).
    Either way the returned record names what the stage uses; the caller keeps it while it
    is ``outstanding`` (CUDA only). CPU-offloaded gradient shards go to host memory with
    non-blocking copies there, added once landed.
    """
    target = inflight.target
    sizes = f"{target.world} x {sum(p.layout.local_numel for p in inflight.params)} elements"
    if inflight.exchange is not None:  # the headers first: data that does not match may never come
        _debug.wait(inflight.exchange.header_exchange, "reduce_scatter", target.label, sizes, target.root)
        _checks.check_reduce_headers(target, inflight.exchange.headers)
    _debug.wait(inflight.done, "reduce_scatter", target.label, sizes, target.root)  # CUDA: the compute stream
    out = inflight.exchange.reduced() if inflight.exchange is not None else inflight.output
    streams = streams_for(out.device)
    with streams.side("all_reduce"):
        inflight.done.wait()  # CUDA: the all-reduce stream too (a second waiter)
        replicas = _reduce_across_replicas(inflight, out)
        landed, deferred = _divide_and_accumulate(inflight, out, streams.cuda) if replicas.all_reduced else ([], [])
        done = streams.issued(None)
    reduced = ReducedGrads(done, (out, *replicas.read), tuple(deferred))
    if not replicas.all_reduced:
        return reduced  # HSDP with its all-reduce off: the sums wait in target.partial
    if streams.cuda and any(_compat.has_post_accumulate_grad_hooks(p.sharded) for p in landed):
        done.wait()  # user hooks (e.g. an optimizer step per parameter) read .grad on the compute stream
    for p in landed:
        p.run_sharded_grad_hooks()  # the user's, e.g. an optimizer step per parameter
    _trace.emit("reduce_scatter_done", target.label, scheduled=False)
    return reduced


def _divide_and_accumulate(inflight: ReduceScatterInFlight, out: torch.Tensor, cuda: bool
                           ) -> tuple[list[ShardedParam], list[tuple[ShardedParam, torch.Tensor]]]:
    """On the all-reduce stage: post-divide ``out``, run the all-reduce hook, then add each
    parameter's chunk into its ``.grad``, or, CUDA with CPU offload, stage it to host memory.
    Returns the parameters whose ``.grad`` is final, and the (parameter, staged chunk) pairs."""
    target = inflight.target
    landed: list[ShardedParam] = []
    deferred: list[tuple[ShardedParam, torch.Tensor]] = []
    if inflight.post_divide is not None and inflight.post_divide != 1:
        out.div_(inflight.post_divide)
    if target.hook is not None:
        _run_all_reduce_hook(*target.hook, out)
    base = out.storage_offset()
    shards = [out.as_strided(p.layout.local_shape, p.layout.local_stride, base + off)
              for p, off in zip(inflight.params, inflight.offsets)]
    if target.check_finite:
        _checks.record_nonfinite(target.root, inflight.params, shards)
    for p, shard in zip(inflight.params, shards):
        if cuda and p.padded_local.device.type == "cpu":
            deferred.append((p, _stage_to_host(p, shard)))
        else:
            p.add_sharded_grad(shard)
            landed.append(p)
    return landed, deferred


def _reduce_across_replicas(inflight: ReduceScatterInFlight, out: torch.Tensor) -> _AcrossReplicas:
    """HSDP: all-reduce ``out`` over the replicas, with the sums kept while the all-reduce was off
    added in first (they are returned: the stage reads them, so they live as long as it does).

    With the all-reduce off this time, ``out`` waits in ``target.partial`` instead.
    """
    target = inflight.target
    if target.replicate_group is None:
        return _AcrossReplicas(True, ())
    earlier = target.partial.pop(out.dtype, None)
    read: tuple[torch.Tensor, ...] = ()
    if earlier is not None:  # reduce-scattered while all-reduce was off
        out += earlier
        read = (earlier,)
    if not target.all_reduce:
        target.partial[out.dtype] = out
        return _AcrossReplicas(False, read)
    _trace.emit("all_reduce", target.label)
    sizes = f"{out.numel()} elements over {target.replicate_world} replicas"
    _debug.log_collective("all_reduce", target.label, target.replicate_group, sizes, out.dtype, target.root)
    work = dist.all_reduce(out, op=inflight.op, group=target.replicate_group, async_op=True)
    _debug.wait(work, "all_reduce", target.label, sizes, target.root)  # CUDA: the all-reduce stream waits
    return _AcrossReplicas(True, read)
