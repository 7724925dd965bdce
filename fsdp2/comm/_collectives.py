"""What every transport shares: the collectives in flight, and finishing a reduction's
communication (HSDP's all-reduce, the division). What the reduced gradients then become
(``.grad``, the user's hooks) is the runtime's (``runtime/_reduction.py``).

All-gather moves bytes, so parameters of different dtypes (fp32 next to bf16,
as LoRA adapters often are) travel in one collective; each parameter's bytes
start at a 16-byte aligned offset so they can be viewed back as their dtype.
Reduce-scatter does arithmetic, so it runs once per reduce dtype present.

Layouts (for ``R`` ranks, each contributing a slice of ``S`` bytes):

* send slice and flat all-gather output, rank-major: ``[rank0: hdr p0 p1 ...][rank1: hdr p0 p1 ...]``;
  ``hdr`` is a 16-byte header naming what the rank gathers (checked in ``runtime/_checks.py``;
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
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

from .. import _compat
from .._format import REDUCE_MAGIC, packed_offsets
from ..diagnostics import _bytes, _debug, _trace
from ._quantize import GradChunks, block_slices, simulated_ranges
from ._streams import Completion

if TYPE_CHECKING:
    from .._format import Chunking, GatherFormat

__all__ = [
    "GatherTargets", "AllGatherInFlight", "ReduceTarget", "ReduceScatterInFlight", "AcrossReplicas",
    "QuantizedReduction", "reduce_op", "check_reduce_headers", "wait_reduce_scatter", "reduce_across_replicas",
    "show_flat_all_gather", "show_flat_reduce_scatter", "show_flat_all_to_all", "copy_rank_major",
    "quantized_all_reduce",
]


class FinishesAllGather(Protocol):
    """The transport that issued an all-gather, as its record keeps it (``_interface.Transport``,
    which sits above this file: it returns these records)."""

    def finish_all_gather(self, inflight: AllGatherInFlight, targets: GatherTargets) -> None: ...


class AllGatherInFlight:
    """An all-gather issued but maybe not finished; ``transport.finish_all_gather`` finishes it.

    What every transport's record has; each transport's subclass keeps its own buffers and
    what its finish reads (``_flat.FlatAllGather``, ``cpu/_transport.ExchangeAllGatherInFlight``).
    Every tensor it holds must outlive ``done``.
    """

    __slots__ = ("done", "fmt", "headers", "transport")

    def __init__(self, done: Completion, fmt: GatherFormat, headers: torch.Tensor | None,
                 transport: FinishesAllGather) -> None:
        self.done = done
        self.fmt = fmt
        self.headers = headers  # (world, HEADER) bytes: the ranks' schedule headers, once done; None: unchecked
        self.transport = transport

    def headers_done(self) -> Completion | None:
        """Where the headers arrive ahead of the data: their own completion (checked before the
        rest is waited for). None: they come with the data."""
        return None

    def release(self) -> Completion | None:
        """What must finish, once ``done``, before the unsharded buffer is freed or refilled
        (peers that read this rank's chunks out of it, maybe after this rank's own wait
        returned); this record must stay alive until then. None: ``done`` is all."""
        return None

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (send buffers included, even when they are the shards)."""
        raise NotImplementedError


class GatherTargets:
    """Where one all-gather's entries go in a group's unsharded buffer; made once per world
    (the views outlive the buffer's frees, see ``ParamGroup._targets``).

    ``chunks[i]``: entry ``i``'s padded full tensor viewed ``(world, *local_shape)``
    (``Chunking.chunks_view``), where the exchange receives and the flat copy-out writes.
    ``ranks``: how many ranks' chunks, from rank 0, the flat copy-out writes: where the
    unsharded parameters are all that reads the buffer, the ranks holding true rows
    (``GatherFormat.data_ranks``; the chunks after them are padding no one reads, left as
    they were), else all of them.
    """

    def __init__(self, fmt: GatherFormat, chunks: list[torch.Tensor], ranks: int | None = None) -> None:
        self.fmt = fmt
        self.chunks = chunks
        self.ranks = fmt.world if ranks is None else ranks
        self.split_is_data: list[bool] = []  # per piece of ``split``: an entry's (True) or padding

    @cached_property
    def copied_chunks(self) -> list[torch.Tensor]:
        """``chunks``, the first ``ranks`` of each: what the flat copy-out writes."""
        if self.ranks == self.fmt.world:
            return self.chunks
        with torch.inference_mode(False):
            return [c[:self.ranks] for c in self.chunks]

    @cached_property
    def split(self) -> tuple[list[int], list[torch.Tensor]] | None:
        """The flat copy-out as one ``split_with_sizes_copy`` of the first ``ranks`` slices after
        their headers: the byte sizes in order (each entry, then its alignment padding where it
        has some) and where each goes (the entry's chunks as bytes; a scratch column for
        padding). None where an entry's chunks are not one block of memory each (``Shard(d)``
        with ``d != 0``)."""
        with torch.inference_mode(False):  # written outside inference mode too: no inference views
            return self._split()

    def _split(self) -> tuple[list[int], list[torch.Tensor]] | None:
        chunks, fmt = self.chunks, self.fmt
        if not all(c.is_contiguous() for c in chunks):
            return None
        world, ranks = fmt.world, self.ranks
        ends = [*fmt.offsets[1:], fmt.slice_bytes]
        sizes: list[int] = []
        places: list[torch.Tensor | None] = []  # None: padding, copied to scratch
        for chunk, start, end in zip(chunks, fmt.offsets, ends):
            data = chunk.numel() // world * chunk.element_size()
            sizes.append(data)
            places.append(chunk.view(world, -1)[:ranks].view(torch.uint8))
            if end - start > data:
                sizes.append(end - start - data)
                places.append(None)
        pads = [size for size, place in zip(sizes, places) if place is None]
        # One block of memory per padding piece (rows of one flat scratch, not columns of a 2-D
        # one): with every piece dense, CUDA runs the whole copy-out as one fused kernel.
        scratch = iter(torch.empty(ranks * sum(pads), dtype=torch.uint8, device=chunks[0].device)
                       .split([ranks * pad for pad in pads]) if pads else ())
        scratch = (piece.view(ranks, -1) for piece in scratch)
        self.split_is_data = [place is not None for place in places]
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
    force_sum: bool = False  # SUM then divide, never the backend's AVG (set_force_sum_reduction_for_comms)
    replicate_block: int = 0  # QuantizedComm(gradient_axes="replicate"|"both"): the all-reduce's
    replicate_bits: int = 8  # values per scale and bits per value; 0: the all-reduce is unquantized


class ReduceScatterInFlight:
    """One dtype bucket's reduce-scatter: :func:`wait_reduce_scatter`, then
    :func:`reduce_across_replicas`, give this rank's reduced entries.

    What every transport's record has; each transport's subclass keeps the buffers it sends
    from and receives into (``_flat.FlatReduceScatter``, ``cpu/_transport.ExchangeReduceScatterInFlight``).
    """

    __slots__ = ("done", "layouts", "offsets", "op", "post_divide", "target")

    def __init__(self, done: Completion, layouts: tuple[Chunking, ...], offsets: tuple[int, ...], op: dist.ReduceOp,
                 post_divide: float | None, target: ReduceTarget) -> None:
        self.done = done
        self.layouts = layouts
        self.offsets = offsets  # of each entry in the reduced row, in elements
        self.op = op
        self.post_divide = post_divide
        self.target = target

    def wait(self, sizes: str) -> torch.Tensor:
        """Wait (CUDA: the compute stream waits) and return this rank's reduced row; ``sizes``
        names the collective in errors."""
        raise NotImplementedError

    def buffers(self) -> list[torch.Tensor]:
        """The communication memory it holds (not the unsharded gradients it reads)."""
        raise NotImplementedError

    def shards(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Each entry's reduced chunk in ``out``, shaped as its local shard."""
        base = out.storage_offset()
        return [out.as_strided(lay.local_shape, lay.local_stride, base + off)
                for lay, off in zip(self.layouts, self.offsets)]


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


class QuantizedReduction(NamedTuple):
    """One quantized reduce-scatter (``QuantizedComm(gradients=...)``) as every transport runs it:
    the gradients laid out rank-major, each destination rank's row quantized per block
    (``GradChunks``), the rows exchanged (the flat transport's all-to-all, the exchange's messages
    or reads), and the ``world`` rows a rank received dequantized and summed in ``acc``, divided
    and cast. The same ops on the same bytes on either transport: bit-identical results.

    The division: all of it after the sum without HSDP (an fp32 sum needs no pre-divide); with
    HSDP what the shard axis' reduce-scatter would have divided (``reduce_op``'s AVG, or its
    pre-divide), the rest after the replicas' all-reduce (``op``, ``post_divide``), unchanged.
    """

    chunks: GradChunks  # the packed rows, one per destination rank
    offsets: tuple[int, ...]  # of each gradient's chunk in a row, in elements
    op: dist.ReduceOp  # what HSDP's all-reduce then runs
    post_divide: float | None  # after it
    divide: float  # the local sum's division
    acc: torch.dtype  # the sum's dtype: fp32, or the reduce dtype where wider

    @classmethod
    def plan(cls, layouts: Sequence[Chunking], dtype: torch.dtype, target: ReduceTarget, block: int,
             bits: int) -> QuantizedReduction:
        """The reduction of gradients cut as ``layouts`` in ``dtype`` over ``target``; logged
        (debug mode) and its bytes counted: every rank's packed row, to its owner."""
        world = target.world
        offs, total = packed_offsets([lay.local_numel for lay in layouts], align=False)
        op, pre, post = reduce_op(dtype, world * target.replicate_world, target.divide_factor, target.force_sum)
        if target.replicate_group is None:
            op, divide, post = dist.ReduceOp.SUM, target.divide_factor, None
        elif op == dist.ReduceOp.AVG:
            divide = float(world)  # the all-reduce's AVG divides by the replicas
        else:
            divide = pre or 1.0
        chunks = GradChunks(world, total, block, bits)
        if _debug.enabled():
            sizes = f"{world} x {total} elements, int{bits} all-to-all of {chunks.chunk_bytes} bytes per rank"
            _debug.log_collective("reduce_scatter", target.label, target.group, sizes, dtype, target.root)
        if _bytes._ACTIVE:
            _bytes.count("reduce_scatter", chunks.chunk_bytes, target.group)
        return cls(chunks, tuple(offs), op, post, divide, dtype if dtype.itemsize > 4 else torch.float32)

    def quantize(self, staged: torch.Tensor, send: torch.Tensor, residuals: Sequence[torch.Tensor] | None) -> None:
        """Quantize the rank-major gradients ``staged`` (``(world, numel)``) into ``send``'s rows,
        a range of columns at a time (``_quantize.block_slices``: the copies in ``acc`` are a
        range's). ``residuals`` (error feedback): each gradient's ``(world, local_numel)`` fp32
        residual, added to its columns first, then overwritten with what the quantization lost there."""
        chunks = self.chunks
        values, scales = chunks.views(send)
        ranges = block_slices(chunks.world, chunks.numel, chunks.block, chunks.bits)
        first_columns = [off for res, off in zip(residuals or (), self.offsets) if res.shape[1]]
        with torch.no_grad():
            for c0, c1 in simulated_ranges(ranges, send.device, first_columns):
                rows = staged[:, c0:c1].to(self.acc, copy=residuals is not None)
                spans = self._residual_spans(residuals, c0, c1)
                for res, mine, theirs in spans:
                    rows[:, mine] += res[:, theirs]
                error = torch.empty_like(rows) if residuals is not None else None
                chunks.quantize_range(rows, values, scales, c0, error)
                for res, mine, theirs in spans:
                    res[:, theirs].copy_(error[:, mine])

    def _residual_spans(self, residuals: Sequence[torch.Tensor] | None, c0: int,
                        c1: int) -> list[tuple[torch.Tensor, slice, slice]]:
        """Each residual's columns within ``[c0, c1)``: (residual, in the range, in the residual)."""
        spans = []
        for res, off in zip(residuals or (), self.offsets):
            lo, hi = max(c0, off), min(c1, off + res.shape[1])
            if lo < hi:
                spans.append((res, slice(lo - c0, hi - c0), slice(lo - off, hi - off)))
        return spans

    def summed(self, recv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's reduced row from the packed rows ``recv`` it received (row ``q`` from rank
        ``q``): summed in ``acc``, divided, in ``dtype``."""
        with torch.no_grad():
            summed = self.chunks.dequantize_sum(recv, self.acc)
            if self.divide != 1:
                summed.div_(self.divide)
            return summed.to(dtype) if dtype != self.acc else summed.contiguous()


def copy_rank_major(by_rank: torch.Tensor, layouts: Sequence[Chunking], grads: Sequence[torch.Tensor],
                    offsets: Sequence[int]) -> None:
    """Copy each full gradient's chunk ``r`` into row ``r`` of ``by_rank`` (world, total)."""
    world = by_rank.shape[0]
    if all(lay.dim == 0 and lay.local_numel for lay in layouts):  # the usual case: one op
        ranks = _data_ranks(layouts, world)
        with torch.no_grad():
            if ranks < world:  # the rows of the ranks after ``ranks`` are padding of every gradient: zeros
                _compat.chunk_cat(list(grads), ranks, by_rank[:ranks])
                by_rank[ranks:].zero_()
            else:
                _compat.chunk_cat(list(grads), world, by_rank)
        return
    targets, sources = [], []  # even shards: one foreach copy for all of them
    with torch.no_grad():
        for lay, grad, off in zip(layouts, grads, offsets):
            dst = by_rank.as_strided((world, *lay.local_shape), (by_rank.stride(0), *lay.local_stride),
                                     by_rank.storage_offset() + off)
            if lay.shape[lay.dim] == lay.chunk * world:
                targets.append(dst)
                sources.append(lay.chunks_view(grad.contiguous()))
            else:  # uneven: the ranks holding whole chunks, the one holding the rest, then zeros
                _copy_uneven(dst, lay, grad)
        if targets:
            torch._foreach_copy_(targets, sources)


def _copy_uneven(dst: torch.Tensor, lay: Chunking, grad: torch.Tensor) -> None:
    """``dst`` (world, *local_shape) := each rank's chunk of ``grad`` along ``lay.dim``, zero past
    its end: a few ops whatever the world size (not one per rank)."""
    dim, chunk, world = lay.dim, lay.chunk, dst.shape[0]
    n = grad.shape[dim]
    whole, rest = divmod(n, chunk) if chunk else (0, 0)
    if whole:  # ranks 0..whole-1: whole chunks, as one strided copy
        dst.narrow(0, 0, whole).copy_(grad.narrow(dim, 0, whole * chunk).unflatten(dim, (whole, chunk)).movedim(dim, 0))
    if whole < world:
        dst.narrow(0, whole, world - whole).zero_()
        if rest:  # rank ``whole``: its true rows, the padding after them stays zero
            dst[whole].narrow(dim, 0, rest).copy_(grad.narrow(dim, whole * chunk, rest))


def _data_ranks(layouts: Sequence[Chunking], world: int) -> int:
    """How many ranks, from rank 0, receive true rows of some gradient (``world`` where that
    cannot be cut short). Chunking the gradients into that many pieces gives each the rows per
    rank it has over ``world`` (``ceil(n / ranks)`` is the chunk for any ``ranks`` between the
    gradient's own data ranks and ``world``), so the copy-in of the ranks before it is the same
    and the rest of the rank-major buffer is zeros, written in one fill instead of a padded
    piece per gradient per rank."""
    ranks = 0
    for lay in layouts:
        ranks = max(ranks, lay.data_ranks)
    if not ranks or ranks >= world:
        return world
    for lay in layouts:
        if -(-lay.shape[0] // ranks) != lay.chunk:
            return world
    return ranks


def show_flat_all_gather(fmt: GatherFormat, pg: dist.ProcessGroup) -> None:
    """Under a dispatch mode (``CommDebugMode``): the flat all-gather a transport's messages or
    reads stand for, issued on meta tensors of its shapes, so the mode sees the collective
    torch's FSDP2 (and fsdp2's flat transport) issues. Meta tensors move no data: c10d's meta
    kernel returns at once, on this rank alone, whatever the others do. Without a mode, or on
    one rank (no collective there, as with the flat transport and torch), nothing.
    """
    if fmt.world > 1 and _compat.dispatch_modes_active():
        meta = torch.device("meta")
        send = torch.empty(fmt.slice_bytes, dtype=torch.uint8, device=meta)
        out = torch.empty(fmt.world * fmt.slice_bytes, dtype=torch.uint8, device=meta)
        _compat.all_gather_flat(out, send, group=pg)


def show_flat_reduce_scatter(numel: int, world: int, dtype: torch.dtype, op: dist.ReduceOp,
                             pg: dist.ProcessGroup) -> None:
    """As :func:`show_flat_all_gather`, for a reduce-scatter of ``numel`` elements per rank."""
    if _compat.dispatch_modes_active():
        meta = torch.device("meta")
        out = torch.empty(numel, dtype=dtype, device=meta)
        _compat.reduce_scatter_flat(out, torch.empty(world * numel, dtype=dtype, device=meta), op=op, group=pg)


def show_flat_all_to_all(nbytes: int, pg: dist.ProcessGroup) -> None:
    """As :func:`show_flat_all_gather`, for a quantized reduction's all-to-all of ``nbytes`` bytes
    (the flat transport's ``all_to_all_single``)."""
    if _compat.dispatch_modes_active():
        send = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("meta"))
        dist.all_to_all_single(torch.empty_like(send), send, group=pg)


def check_reduce_headers(target: ReduceTarget, headers: torch.Tensor) -> None:
    """Raise on every rank whose peers reduce other gradients than it does (before summing them)."""
    rows = headers.view(torch.int32).tolist()  # (world, 4)
    if any(row[0] != REDUCE_MAGIC for row in rows) or all(row == rows[0] for row in rows):
        return
    ranks = dist.get_process_group_ranks(target.group)
    odd = next(r for r, row in enumerate(rows) if row != rows[0])
    if rows[odd][1] != rows[0][1]:
        raise RuntimeError(
            f"fsdp2: reduce-scatters of different groups matched up: rank {ranks[odd]} reduces group "
            f"#{rows[odd][1]} while rank {ranks[0]} reduces group #{rows[0][1]}: ranks ran different "
            "backwards. Every rank must run the same forwards and backwards in the same order"
        )
    raise RuntimeError(
        f"fsdp2: ranks disagree on which parameters of {target.label} received gradients: rank "
        f"{ranks[odd]} reduces {rows[odd][2]} of them, rank {ranks[0]} reduces {rows[0][2]}"
        f"{' (other ones)' if rows[odd][2] == rows[0][2] else ''}. A branch that runs on some ranks "
        "only leaves its parameters without gradients there: call set_reduce_scatter_unused_params(True) "
        "on the model (zeros for the gradients a rank did not produce, as DDP's find_unused_parameters), "
        "or run the branch on every rank: see docs/troubleshooting.md"
    )


def wait_reduce_scatter(inflight: ReduceScatterInFlight) -> torch.Tensor:
    """Wait for the reduce-scatter (CUDA: the compute stream waits) and return this rank's
    reduced row; errors name the group and the sizes."""
    return inflight.wait(f"{inflight.target.world} x {sum(lay.local_numel for lay in inflight.layouts)} elements")


class AcrossReplicas(NamedTuple):
    """What HSDP's step did with a reduce-scatter's output (:func:`reduce_across_replicas`)."""

    all_reduced: bool  # False: the output waits in ``target.partial`` for a later all-reduce
    read: tuple[torch.Tensor, ...]  # the earlier partial sums added into it (the caller keeps them)


def reduce_across_replicas(inflight: ReduceScatterInFlight, out: torch.Tensor) -> AcrossReplicas:
    """The rest of the reduction, on the calling stream: HSDP's all-reduce of ``out`` over the
    replicas, with the sums kept while the all-reduce was off added in first, then the
    post-divide. With the all-reduce off this time, ``out`` waits in ``target.partial`` instead
    (not divided: a later reduction divides the whole sum).
    """
    target = inflight.target
    read: tuple[torch.Tensor, ...] = ()
    if target.replicate_group is not None:
        earlier = target.partial.pop(out.dtype, None)
        if earlier is not None:  # reduce-scattered while all-reduce was off
            out += earlier
            read = (earlier,)
        if not target.all_reduce:
            target.partial[out.dtype] = out
            return AcrossReplicas(False, read)
        _trace.emit("all_reduce", target.label)
        sizes = f"{out.numel()} elements over {target.replicate_world} replicas"
        _debug.log_collective("all_reduce", target.label, target.replicate_group, sizes, out.dtype, target.root)
        if target.replicate_block and target.replicate_world > 1:  # one replica: nothing to reduce
            _quantized_all_reduce(out, target, inflight.op == dist.ReduceOp.AVG, sizes)
        else:
            if _bytes._ACTIVE:
                per_peer = 2 * -(-out.numel() // target.replicate_world) * out.element_size()
                _bytes.count("all_reduce", per_peer, target.replicate_group)
            work = dist.all_reduce(out, op=inflight.op, group=target.replicate_group, async_op=True)
            _debug.wait(work, "all_reduce", target.label, sizes, target.root)  # CUDA: the calling stream waits
    if inflight.post_divide is not None and inflight.post_divide != 1:
        out.div_(inflight.post_divide)
    return AcrossReplicas(True, read)


def _quantized_all_reduce(out: torch.Tensor, target: ReduceTarget, average: bool, sizes: str) -> None:
    """HSDP's all-reduce of ``out`` over the replicas with quantized values, in place
    (:func:`quantized_all_reduce` over ``target.replicate_group``)."""
    group, replicas = target.replicate_group, target.replicate_world

    def all_to_all(recv: torch.Tensor, send: torch.Tensor) -> None:
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        _debug.wait(work, "all_reduce", target.label, sizes, target.root)

    def all_gather(gathered: torch.Tensor, packed: torch.Tensor) -> None:
        work = _compat.all_gather_flat(gathered, packed, group=group, async_op=True)
        _debug.wait(work, "all_reduce", target.label, sizes, target.root)

    if _bytes._ACTIVE:
        chunk, block, bits = -(-out.numel() // replicas), target.replicate_block, target.replicate_bits
        _bytes.count("all_reduce", GradChunks(replicas, chunk, block, bits).chunk_bytes
                     + GradChunks(1, chunk, block, bits).chunk_bytes, group)
    quantized_all_reduce(out, replicas, target.replicate_block, target.replicate_bits, average, all_to_all, all_gather)


def quantized_all_reduce(out: torch.Tensor, replicas: int, block: int, bits: int, average: bool,
                         all_to_all: Callable[[torch.Tensor, torch.Tensor], None],
                         all_gather: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """The all-reduce of ``out`` over ``replicas`` ranks with quantized values, in place: each
    replica quantizes its ``out`` cut into ``replicas`` chunks (``block`` values per scale,
    ``bits`` per value), one ``all_to_all(recv, send)`` sends chunk ``r`` to replica ``r``, which
    sums the ones it got in fp32 (or wider), quantizes the sum and ``all_gather(output, input)``s
    it; every replica then dequantizes the same bytes, so the replicas keep equal gradients.
    ``average``: divided by ``replicas`` (the all-reduce's AVG). Quantized and dequantized a
    range of whole blocks of every chunk at a time (``_quantize.block_slices``): the fp32
    temporaries are a few times a range's size, not ``out``'s. The memory planner runs it on
    the meta device with collectives that do nothing."""
    acc = out.dtype if out.dtype.itemsize > 4 else torch.float32
    chunk = -(-out.numel() // replicas)
    scatter = GradChunks(replicas, chunk, block, bits)
    gather = GradChunks(1, chunk, block, bits)
    in_place = out.is_contiguous()
    flat = out.view(-1) if in_place else out.reshape(-1).clone()
    ranges = simulated_ranges(block_slices(replicas, chunk, block, bits), out.device)
    with torch.no_grad():
        send = torch.empty(replicas * scatter.chunk_bytes, dtype=torch.uint8, device=out.device)
        values, scales = scatter.views(send)
        for c0, c1 in ranges:
            part = torch.zeros(replicas, c1 - c0, dtype=acc, device=out.device)
            for rows, cols in _chunk_columns(flat, replicas, chunk, c0, c1):
                part[rows, :cols.shape[-1]].copy_(cols)
            scatter.quantize_range(part, values, scales, c0, None)
            del part
        recv = torch.empty_like(send)
        all_to_all(recv, send)
        mine = scatter.dequantize_sum(recv, acc)
        del send, recv
        packed = torch.empty(gather.chunk_bytes, dtype=torch.uint8, device=out.device)
        gather.quantize(mine[None], packed)
        del mine
        gathered = torch.empty(replicas * gather.chunk_bytes, dtype=torch.uint8, device=out.device)
        all_gather(gathered, packed)
        values, scales = scatter.views(gathered)
        for c0, c1 in ranges:
            part = scatter.dequantize_range(values, scales, c0, c1, acc)
            if average:
                part /= replicas
            for rows, cols in _chunk_columns(flat, replicas, chunk, c0, c1):
                cols.copy_(part[rows, :cols.shape[-1]])
            del part
        if not in_place:
            out.copy_(flat.view(out.shape))


def _chunk_columns(flat: torch.Tensor, replicas: int, chunk: int, c0: int,
                   c1: int) -> list[tuple[slice | int, torch.Tensor]]:
    """Columns ``[c0, c1)`` of ``flat`` cut into ``replicas`` chunks of ``chunk`` elements (the
    last ones short or empty): (rows, a view of ``flat``) for the full chunks together and for
    the one cut short; the chunks past ``flat``'s end have none."""
    n = flat.numel()
    full = min(n // chunk, replicas) if chunk else 0
    out: list[tuple[slice | int, torch.Tensor]] = []
    if full:
        out.append((slice(0, full), flat[:full * chunk].view(full, chunk)[:, c0:c1]))
    lo, hi = full * chunk + c0, min(full * chunk + c1, n)
    if full < replicas and hi > lo:
        out.append((full, flat[lo:hi]))
    return out
