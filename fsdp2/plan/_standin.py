"""What the memory planner cannot run for real on the meta device: the CPU transport's buffers.

The planner (``_simulate.py``) runs fsdp2 itself, so every buffer the runtime allocates, and
when it frees it, is the runtime's own. Two things a fake process group cannot reproduce are
stood in for here, by transports the planner gives each group in place of the one a real run
picks (``comm/_transport.choose_transport``):

* ``PlannedExchange`` (``_exchange_standin.py``): the CPU exchanges (``comm/cpu``) move bytes point to point, or by
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
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from .._format import aligned
from ..comm._collectives import ReduceScatterInFlight, ReduceTarget
from ..comm._flat import FlatReduceScatter, FlatTransport
from ..comm._streams import Completion
from ..comm._transport import GroupBytes, Transport, choose_transport
from ..diagnostics import _trace

if TYPE_CHECKING:
    from .._format import Chunking
    from ..comm._comm import AllGather, ReduceScatter
    from ..runtime._group import ParamGroup
    from ..runtime._param import ShardedParam

__all__ = ["GlooFlat", "group_bytes", "planned_transport"]


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
    if not isinstance(real, FlatTransport):  # the CPU exchange (imported by the choice: only where taken)
        from ._exchange_standin import PlannedExchange

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
