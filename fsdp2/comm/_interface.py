"""The transport interface: how one group's all-gather and reduce-scatter move bytes.

The runtime (``runtime/_group.py``) never asks which transport it has; it asks the
transport. What a transport is handed (``GatherSource``: the group whose entries it
gathers; ``GroupBytes``: a group's sizes, for the planner), what it gives back (the
records of ``_collectives.py``; ``BufferNeeds``), and ``Transport`` itself. The two
implementations (``_flat.py``, ``cpu/_transport.py``) build on this file; which one a group
gets is ``_transport.py``'s choice, above them both.

``FSDP2_CPU_COLLECTIVES=auto|read|exchange|flat`` picks for CPU groups; :func:`cpu_transport`
is the only reader of it.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .._format import Chunking, GatherFormat
    from ._collectives import AllGatherInFlight, GatherTargets, ReduceScatterInFlight, ReduceTarget
    from ._comm import AllGather, ReduceScatter

__all__ = ["CPU_COLLECTIVES_ENV", "BufferNeeds", "GatherSource", "GroupBytes", "Transport", "cpu_transport"]

CPU_COLLECTIVES_ENV = "FSDP2_CPU_COLLECTIVES"
CPU_TRANSPORTS = ("auto", "read", "exchange", "flat")


class GatherSource(Protocol):
    """What a transport asks of the group whose parameters it gathers."""

    device: torch.device
    label: str

    def laid_out(self, fmt: GatherFormat) -> tuple[torch.Tensor | None, bool]:
        """This rank's entries already laid out as ``fmt``'s slice (header room first), if they
        are, and whether only the group writes that memory (True: sent as it is by any unshard)."""
        ...

    def header_room(self, send: torch.Tensor) -> torch.Tensor:
        """The first 16 bytes of the slice ``send`` (``laid_out``'s, or a copy), as a tensor the
        header is written into under a dispatch mode."""
        ...

    def entries(self, fmt: GatherFormat) -> list[torch.Tensor]:
        """This rank's part of each entry of ``fmt``, where it lives now."""
        ...

    def targets(self, fmt: GatherFormat) -> GatherTargets:
        """Where the gathered entries go: the unsharded buffer (allocated by this call)."""
        ...


@dataclass
class GroupBytes:
    """One group's sizes on one rank, from which a transport says what buffers it needs (the
    memory planner asks, without running anything)."""

    unsharded: int = 0
    """The unsharded buffer: every entry in its gathered dtype, padded, 16-byte aligned."""
    slice: int = 0
    """This rank's all-gather entries, each 16-byte aligned (the header not included)."""
    reduce: int = 0
    """The full gradients in their reduce dtype, padded."""
    packed: bool = True
    """The shards live in the send slice (no cast, no offload): no copy-in."""
    entries: list[tuple[int, int, bool]] = field(default_factory=list)
    """Per tensor: its gathered chunk's bytes, its full gradient's bytes in the reduce dtype,
    and whether the gradient is copied before it is sent (cast, padded or pre-divided)."""


class BufferNeeds(NamedTuple):
    """The communication bytes one group's collectives hold on a rank (``Transport.buffer_needs``)."""

    gather: int
    """While its all-gather is in flight (send and receive buffers, headers)."""
    gather_until_reshard: bool
    """Those stay until the unsharded buffer is freed (peers read from it), not the wait."""
    reduce_sent: int
    """The reduce-scatter's input side (send buffer or the copies it sends from)."""
    reduce_received: int
    """Its output side, the output included."""
    reduce_holds_gradients: bool
    """The full gradients stay alive until the reduce-scatter finishes (sent from where they are)."""
    reduce_copies_in: bool = True
    """The gradients are copied into the send buffer and freed before the output is allocated."""
    reduce_input_copy: int = 0
    """A copy of the input the backend makes and ops see at the wait (gloo's flat reduce-scatter)."""


class Transport(ABC):
    """How a group's collectives move bytes. One object per group and collective kind."""

    name: ClassVar[str]
    gathers_in_place: ClassVar[bool] = False
    """The all-gather receives into the unsharded buffer itself, so it is allocated at issue."""
    reduce_headers: ClassVar[bool] = False
    """A reduce-scatter carries this rank's schedule header (``_checks.reduce_header``)."""

    def probe(self, pg: dist.ProcessGroup) -> None:  # noqa: B027 - a no-op unless overridden
        """Collective, once per process group, at the first all-gather over it (every rank of
        ``pg`` is there): find out what the ranks can do for each other."""

    @abstractmethod
    def start_all_gather(self, source: GatherSource, fmt: GatherFormat, pg: dist.ProcessGroup,
                         header: torch.Tensor | None, explicit: bool) -> AllGatherInFlight:
        """Issue the all-gather of ``source``'s entries over ``pg``; ``header``: this rank's schedule
        header (None: not checked); ``explicit``: the user's ``unshard(async_op=True)``."""

    @abstractmethod
    def finish_all_gather(self, inflight: AllGatherInFlight, targets: GatherTargets) -> None:
        """After the wait: the gathered entries in place in ``targets``."""

    @abstractmethod
    def start_reduce_scatter(self, layouts: Sequence[Chunking], grads: list[torch.Tensor], dtype: torch.dtype,
                             target: ReduceTarget, device: torch.device,
                             header: torch.Tensor | None,
                             residuals: Sequence[torch.Tensor] | None = None) -> ReduceScatterInFlight:
        """Issue the reduce-scatter of the full gradients ``grads`` (cut as ``layouts``) in
        ``dtype``. The transport empties ``grads`` where it no longer needs them (so they can be
        freed early). ``residuals`` (quantized gradients with error feedback): one fp32
        ``(world, local_numel)`` tensor per gradient, added to it before quantizing and
        overwritten with what this quantization lost."""

    @abstractmethod
    def buffer_needs(self, sizes: GroupBytes, world: int, backend: str, reads: bool) -> BufferNeeds:
        """What a group of ``sizes`` holds for its collectives over ``world`` ranks on ``backend``;
        ``reads``: same-host reads are possible (the planner's assumption)."""

    def quantized_buffer_needs(self, slice_bytes: int, row_bytes: int, world: int, backend: str,
                               reads: bool) -> BufferNeeds:
        """What a group's quantized collectives hold besides their quantized buffers, which the
        memory planner allocates itself (``plan/_quantized.py``): an all-gather of quantized
        slices of ``slice_bytes``, a reduce-scatter of packed rows of ``row_bytes`` per rank.
        The flat transport's hold nothing more."""
        return BufferNeeds(0, False, 0, 0, False)

    def with_comms(self, all_gather: AllGather, reduce_scatter: ReduceScatter) -> Transport:
        """This transport with its flat collectives run by these comms (``_comm.py``): the
        exchanges have none to run, so they are unchanged."""
        return self

    def quantizing_gradients(self, block: int, bits: int) -> Transport:
        """This transport reducing gradients quantized (``QuantizedComm(gradients=...)``):
        ``bits``-bit values (8 or 4) with an fp32 scale per ``block`` elements."""
        raise NotImplementedError(f"{type(self).__name__} cannot reduce quantized gradients")

    def reduce_scatters_in_flight(self, world: int) -> int:
        """How many reduce-scatters may be in flight by default once a group issued its own
        (that one included); the oldest are finished first (``runtime/_reduce_queue.py``)."""
        return 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def cpu_transport() -> str:
    """``FSDP2_CPU_COLLECTIVES``, checked: ``auto`` (the default), ``read``, ``exchange`` or ``flat``."""
    choice = os.environ.get(CPU_COLLECTIVES_ENV, "auto")
    if choice not in CPU_TRANSPORTS:
        raise ValueError(f"{CPU_COLLECTIVES_ENV}={choice!r}: use 'auto' (the default), 'read', 'exchange' or 'flat'")
    return choice
