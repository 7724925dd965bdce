"""The flat collectives' two jobs, allocating their buffers and running them, as objects a user can replace.

A *comm* is any object with

* ``allocate(size, *, dtype, device) -> Tensor``: the buffer a collective reads or writes
  (the all-gather's output; the reduce-scatter's input and output), and
* ``__call__(output_tensor, input_tensor, group, [op,] async_op=False) -> Work | None``: run it.

That is the interface of torch's ``AllGather`` / ``ReduceScatter`` (its
``_fully_shard._fsdp_api``), so an object written for torch's ``set_custom_all_gather``
works here unchanged; :class:`AllGather` and :class:`ReduceScatter` are fsdp2's own base
classes for new ones. A group with a custom comm runs the flat transport (the exchanges of
``_exchange.py`` have no flat buffers to allocate and no single collective to replace).

Allocation sources besides ``torch.empty``: the process group's own allocator
(``set_allocate_memory_from_process_group_for_comm``; NCCL can register such memory for
zero-copy transfers; gloo has none, so nothing changes there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .. import _compat

__all__ = ["Comm", "AllGather", "ReduceScatter", "DEFAULT_ALL_GATHER", "DEFAULT_REDUCE_SCATTER",
           "process_group_comms", "check_comm"]


class Comm(ABC):
    """Where a collective's buffers come from."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``size`` (1-D: ``(numel,)``) for the collective to read or write."""


class AllGather(Comm):
    """A flat all-gather: every rank's ``input_tensor`` back to back, rank-major, in ``output_tensor``."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        """Run it; with ``async_op`` return the work handle (or None if it already finished)."""


class ReduceScatter(Comm):
    """A flat reduce-scatter: chunk ``r`` of ``input_tensor`` reduced over the ranks, into rank ``r``'s output."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        """Run it with ``op`` (``AVG`` or ``SUM``); with ``async_op`` return the work handle."""


class _EmptyAlloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _ProcessGroupAlloc:
    """Buffers from the process group's backend allocator where it has one, else ``torch.empty``.

    Whether a device's backend has one is asked once per device: the answer is the
    backend's, fixed when the group was made, and allocation runs at every collective.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._sources: dict[torch.device, Any] = {}  # device -> its backend, or None: torch.empty

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shape = torch.Size(int(n) for n in size)
        source = self._source(torch.device(device))
        if source is None:
            return torch.empty(shape, dtype=dtype, device=device)
        # The backend hands out flat memory (NCCL: registered for zero-copy); shape it as asked.
        return source.allocate_tensor(shape.numel(), dtype=dtype, device=device).view(shape)

    def _source(self, device: torch.device) -> Any:
        if device not in self._sources:
            backend = self.group._get_backend(device)
            self._sources[device] = backend if backend.supports_tensor_alloc(device) else None
        return self._sources[device]


class _Gather:
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        # Looked up at each call (not bound at import) so tests can observe the collective.
        return _compat.all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)


class _Scatter:
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        return _compat.reduce_scatter_flat(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class _DefaultAllGather(_EmptyAlloc, _Gather, AllGather):
    pass


class _DefaultReduceScatter(_EmptyAlloc, _Scatter, ReduceScatter):
    pass


class _ProcessGroupAllGather(_ProcessGroupAlloc, _Gather, AllGather):
    pass


class _ProcessGroupReduceScatter(_ProcessGroupAlloc, _Scatter, ReduceScatter):
    pass


DEFAULT_ALL_GATHER: AllGather = _DefaultAllGather()
DEFAULT_REDUCE_SCATTER: ReduceScatter = _DefaultReduceScatter()


def process_group_comms(all_gather_group: dist.ProcessGroup,
                        reduce_scatter_group: dist.ProcessGroup) -> tuple[AllGather, ReduceScatter]:
    """The default collectives, with buffers from each process group's allocator."""
    return _ProcessGroupAllGather(all_gather_group), _ProcessGroupReduceScatter(reduce_scatter_group)


def check_comm(method: str, comm: Any) -> None:
    """``TypeError`` unless ``comm`` has a callable ``allocate`` and is callable itself."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method}: expected an object with allocate(size, *, dtype, device) and __call__ (subclass "
            f"fsdp2.AllGather / fsdp2.ReduceScatter, or torch's), got {type(comm).__name__}"
        )
