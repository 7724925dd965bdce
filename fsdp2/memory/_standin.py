"""What the memory planner cannot run for real on fake tensors: the CPU transport's buffers.

The planner (``_simulate.py``) runs fsdp2 itself, so every buffer the runtime allocates, and
when it frees it, is the runtime's own. Two things a fake process group cannot reproduce are
stood in for here, by transports the planner gives each group in place of the one a real run
picks (``comm/_transport.choose_transport``):

* ``PlannedExchange``: the CPU exchanges (``comm/cpu``) move bytes point to point, or by
  reading the peers' memory, which needs real peers. The stand-in allocates what the real
  exchange holds, sized by ``ExchangeTransport.buffer_needs`` (the transport's own statement
  of its buffers), and hands the runtime the same in-flight records, so the runtime decides
  when they die: the unsharded buffer allocated at issue and gathered into, the headers and
  descriptors kept until the wait (messages) or the reshard (reads), a reduce-scatter that
  sends from the gradients (holding them until it finishes) into one row per peer.
* ``GlooFlat``: gloo's flat reduce-scatter copies its input where no op sees it; ops see the
  copy at the wait (``FlatTransport.buffer_needs``' ``reduce_input_copy``). The stand-in makes
  that copy at the wait; everything else is the real flat transport, on the fake group.

Everything else (the flat collectives, resharding, prefetching, the reduce-scatter queue, early
release) runs for real.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from .._format import HEADER, GatherFormat, aligned, packed_offsets
from ..comm._collectives import AllGatherInFlight, ReduceScatterInFlight, ReduceTarget, reduce_op
from ..comm._flat import FlatReduceScatter, FlatTransport
from ..comm._streams import Completion
from ..comm._transport import GatherSource, GroupBytes, Transport, choose_transport
from ..comm.cpu._transport import ExchangeTransport
from ..diagnostics import _trace

if TYPE_CHECKING:
    from .._format import Chunking
    from ..comm._collectives import GatherTargets
    from ..comm._comm import AllGather, ReduceScatter
    from ..runtime._group import ParamGroup
    from ..runtime._param import ShardedParam

__all__ = ["GlooFlat", "PlannedExchange", "group_bytes", "planned_transport"]


def group_bytes(params: Sequence[ShardedParam], world: int, reduce_dtype: torch.dtype | None = None) -> GroupBytes:
    """``params``' sizes on one rank as a transport counts them (``GroupBytes``), over ``world`` ranks."""
    out = GroupBytes()
    for p in params:
        lay = p.layout.with_world(world) if p.layout.world != world else p.layout
        rows = lay.shape[lay.dim] if lay.shape else 1
        rest = math.prod(lay.shape) // rows if rows else 0
        orig, pdtype = p.orig_dtype, p.param_dtype
        floating = orig.is_floating_point
        rdtype = (reduce_dtype or p.reduce_dtype) if floating else orig
        out.unsharded += aligned(lay.chunk * world * rest * pdtype.itemsize)
        out.slice += aligned(lay.chunk * rest * pdtype.itemsize)
        reduced = lay.chunk * world * rest * rdtype.itemsize
        out.reduce += reduced
        # fp16 reduces pre-divide their copy (comm/_collectives.reduce_op).
        predivide = floating and rdtype not in (torch.float32, torch.bfloat16)
        copied = floating and pdtype != rdtype or lay.chunk * world != rows or predivide
        out.entries.append((lay.chunk * rest * pdtype.itemsize, reduced, copied))
        out.packed &= pdtype == orig
    return out


def planned_transport(group: ParamGroup, gloo: bool, reads: bool) -> Transport:
    """The transport the planner gives ``group``: the real flat one where a real run takes it
    (every NCCL group), a stand-in otherwise. The choice is ``choose_transport``'s for the
    group's device (CPU for gloo, an accelerator for NCCL) and size, under
    ``FSDP2_CPU_COLLECTIVES`` as set now."""
    real = choose_transport(torch.device("cpu" if gloo else "meta"), group._unsharded_bytes())
    if isinstance(real, ExchangeTransport):
        return PlannedExchange(real.may_read, real.must_read, reads=reads)
    return GlooFlat() if gloo else FlatTransport()


class GlooFlat(FlatTransport):
    """The flat transport on gloo: its reduce-scatter's input copied once more at the wait."""

    def start_reduce_scatter(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                             target: ReduceTarget, device: torch.device, header: torch.Tensor | None,
                             residuals: Sequence[torch.Tensor] | None = None) -> ReduceScatterInFlight:
        inflight = super().start_reduce_scatter(layouts, grads, dtype, target, device, header, residuals)
        if target.world > 1 and isinstance(inflight, FlatReduceScatter):
            inflight.done = Completion(work=_CopyAtWait(inflight.done.work, inflight.held[0], target.label))
        return inflight

    def with_comms(self, all_gather: AllGather, reduce_scatter: ReduceScatter) -> Transport:
        return GlooFlat(all_gather, reduce_scatter, self.grad_block, self.grad_bits)


class _CopyAtWait:
    """A reduce-scatter's work whose wait holds a copy of its input, as gloo's does: made where
    the tracker files it as communication, dropped with the wait."""

    def __init__(self, work: dist.Work | None, send: torch.Tensor, label: str) -> None:
        self.work, self.send, self.label = work, send, label

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        with _trace.issuing("reduce_scatter_copy", self.label):
            copy = torch.empty_like(self.send)
        del copy
        return True


class _PlannedGather(AllGatherInFlight):
    """The exchange all-gather's record: its headers and descriptors (or packed small chunks)
    in one buffer, until the wait, or until the reshard where peers read (``release``)."""

    __slots__ = ("held", "_release")

    def __init__(self, fmt: GatherFormat, transport: Transport, held: torch.Tensor, until_reshard: bool) -> None:
        super().__init__(Completion(), fmt, held[:fmt.world * HEADER].view(fmt.world, HEADER), transport)
        self.held = held
        self._release = Completion() if until_reshard else None

    def release(self) -> Any:
        return self._release

    def buffers(self) -> list[torch.Tensor]:
        return [self.held]


class _PlannedReduce(ReduceScatterInFlight):
    """The exchange reduce-scatter's record: what it sends, the rows it receives and the output;
    the gradients it sends from (``grads``) live as long as it does."""

    __slots__ = ("output", "held", "grads")

    def __init__(self, layouts: tuple[Chunking, ...], offsets: tuple[int, ...], op: dist.ReduceOp,
                 post_divide: float | None, target: ReduceTarget, output: torch.Tensor,
                 held: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> None:
        super().__init__(Completion(), layouts, offsets, op, post_divide, target)
        self.output, self.held, self.grads = output, held, grads

    def wait(self, sizes: str) -> torch.Tensor:
        return self.output

    def buffers(self) -> list[torch.Tensor]:
        return [*self.held, self.output]


class PlannedExchange(ExchangeTransport):
    """The CPU exchange's buffers, sized by its ``buffer_needs``, without peers to exchange with.

    ``reads``: the ranks read each other's memory (one host) rather than send messages.
    """

    def __init__(self, may_read: bool, must_read: bool, *, reads: bool) -> None:
        super().__init__(may_read, must_read)
        self._plan_reads = reads and may_read

    def probe(self, pg: dist.ProcessGroup) -> None:
        """Nothing to find out: the layout says whether the ranks read each other's memory."""

    def reads(self, pg: dist.ProcessGroup) -> bool:
        return self._plan_reads

    def start_all_gather(self, source: GatherSource, fmt: GatherFormat, pg: dist.ProcessGroup,
                         header: torch.Tensor | None, explicit: bool) -> AllGatherInFlight:
        """The unsharded buffer now (received into in place), and the headers and descriptors
        or packed small chunks, kept until the peers have read (reads) or the wait."""
        source.targets(fmt)  # allocates the unsharded buffer
        sizes = GroupBytes(entries=[(lay.local_numel * dt.itemsize, 0, False)
                                    for lay, dt in zip(fmt.layouts, fmt.dtypes)])
        needs = self.buffer_needs(sizes, fmt.world, "gloo", self._plan_reads)
        held = torch.empty(needs.gather, dtype=torch.uint8, device=source.device)
        return _PlannedGather(fmt, self, held, needs.gather_until_reshard)

    def finish_all_gather(self, inflight: AllGatherInFlight, targets: GatherTargets) -> None:
        """The chunks arrived in place: nothing to copy out."""

    def start_reduce_scatter(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                             target: ReduceTarget, device: torch.device, header: torch.Tensor | None,
                             residuals: Sequence[torch.Tensor] | None = None) -> ReduceScatterInFlight:
        """The copies it sends (to cast or pad), one row per peer received into, and the output;
        the gradients sent from where they are stay alive until it finishes."""
        world = target.world
        if world == 1:
            return self._local.start_reduce_scatter(layouts, grads, dtype, target, device, header)
        op, _pre, post = reduce_op(dtype, world * target.replicate_world, target.divide_factor, target.force_sum)
        if op == dist.ReduceOp.AVG:  # the exchange sums; the average is a division after
            post = float(world) * (post or 1.0)
        needs = self.buffer_needs(_layout_bytes(layouts, grads, dtype, world), world, "gloo", self._plan_reads)
        offsets, numel = packed_offsets([lay.local_numel for lay in layouts], align=False)
        output = torch.empty(numel, dtype=dtype, device=device)
        held_header = () if header is None else (header,)
        rest = needs.reduce_received - output.nbytes - HEADER * len(held_header)
        sent = torch.empty(needs.reduce_sent, dtype=torch.uint8, device=device)
        received = torch.empty(max(rest, 0), dtype=torch.uint8, device=device)
        kept = tuple(grads) if needs.reduce_holds_gradients else ()
        grads.clear()
        return _PlannedReduce(tuple(layouts), tuple(offsets), op, post, target, output,
                              (sent, received, *held_header), kept)


def _layout_bytes(layouts: Sequence[Chunking], grads: Sequence[torch.Tensor], dtype: torch.dtype,
                  world: int) -> GroupBytes:
    """The reduce-scatter's side of ``GroupBytes`` for gradients ``grads`` cut as ``layouts``."""
    out = GroupBytes()
    predivide = dtype not in (torch.float32, torch.bfloat16)
    for lay, grad in zip(layouts, grads):
        rows = lay.shape[lay.dim] if lay.shape else 1
        reduced = lay.local_numel * world * dtype.itemsize
        out.reduce += reduced
        floating = dtype.is_floating_point
        copied = floating and (grad.dtype != dtype or predivide) or lay.chunk * world != rows
        out.entries.append((0, reduced, copied))
    return out
